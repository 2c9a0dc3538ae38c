"""Per-rank memory of one MoE layer of backend cuda: an account of the tensors its code allocates, in the order it
allocates and frees them (topoep/runtime/cuda_function.py, symm.py), for any EP size.

Three kinds of memory:
    buffers    the symmetric workspace, once per process and shared by every layer (symm.SymmWorkspace): the
               receive regions of every chunk (main and slot, with their row metadata), the combine target `back`,
               the count all-gather buffers and, with a capacity, the staging of spilled rows;
    slots      the replica pool, once per process: its banks of slots and the gradient-return regions (R x N
               expert-sized regions: the one part that grows with the EP size whatever the capacity);
    call       torch's caching allocator during one layer call, forward and backward: `kept` (saved for backward:
               each chunk's received rows and pre-activations, and the expert outputs for the top-k weights'
               gradient) and the peak of the temporaries above it (GEMM outputs, activations, gradients).
`torch.cuda.max_memory_allocated()` sees only `call` (symmetric memory is allocated outside the caching allocator):
bench/layer_memory.py measures it and prints this model beside it.

A model trains L MoE layers: `call.kept` is held once per layer until its backward, `buffers` and `slots` once.
"""

from __future__ import annotations

from dataclasses import dataclass

from topoep.runtime.backend import receive_regions

INDEX_BYTES = 8  # int64 metadata


@dataclass(frozen=True)
class LayerMemory:
    """Bytes per rank (module docstring)."""

    buffers: int
    slots: int
    kept: int
    peak: int
    """Peak of the caching allocator during one call, forward + backward (kept included)."""

    @property
    def total(self) -> int:
        """What one layer call needs on a rank: buffers + slots + peak."""
        return self.buffers + self.slots + self.peak

    def model_total(self, num_moe_layers: int) -> int:
        """A model's MoE layers (one micro-batch in flight): every layer's kept tensors, one call's temporaries,
        the buffers and slots once."""
        return self.buffers + self.slots + (num_moe_layers - 1) * self.kept + self.peak


def layer_memory(*, num_ranks: int, num_experts: int, hidden: int, ffn_hidden: int, top_k: int, tokens: int,
                 max_tokens: int | None = None, num_slots: int = 2, slots_used: bool = True,
                 capacity_factor: float | None = 1.25, chunks: int = 1, banks: int = 1, dtype_bytes: int = 2,
                 weight_grads: bool = True) -> LayerMemory:
    """The memory of one backend cuda layer call on one rank (module docstring).

    tokens: this call's T; max_tokens: the workspace's (default T). slots_used: the call runs the replica machinery
    (a balancing plan, or the capacity step placed a replica; False when the guard's hint left it out: the slot
    region's tensors are not made). weight_grads: the expert weights' gradients are new tensors of the call (the
    layer's own parameters with no gradient yet, as bench/layer_memory.py measures)."""
    R, H, F, k, b = num_ranks, hidden, ffn_hidden, top_k, dtype_bytes
    T = tokens
    a_cap = (max_tokens or T) * k
    A = T * k
    E_loc, N = num_experts // R, num_slots
    regions, spills = receive_regions(R, a_cap, k, chunks, capacity_factor)
    rows = sum(regions)
    row_b = H * b + INDEX_BYTES  # a received row and its metadata
    count_width = max(num_experts, R * (E_loc + N))
    buffers = (2 * R * count_width * INDEX_BYTES + rows * row_b * (2 if N else 1) + a_cap * H * b
               + (2 * a_cap * H * b + a_cap * INDEX_BYTES if spills else 0))
    expert = 3 * F * H * b
    slots = (banks * N + R * N) * expert if N else 0

    # the caching allocator, in the order of cuda_function.CudaExpertParallelFunction (serial chunks)
    live, peak = 0, 0

    def alloc(n):
        nonlocal live, peak
        live += n
        peak = max(peak, live)

    def free(n):
        nonlocal live
        live -= n

    u = bool(N and slots_used)
    alloc(T * k * b)  # wq
    kept = T * k * b
    for r in regions:  # forward, chunk by chunk
        x_rows = r * H * b * (1 + u)
        alloc(x_rows)  # xm, xs: copies of the received rows (kept)
        kept += x_rows
        for _ in range(1 + u):  # main, then slot GEMMs: h (kept), act (freed), y (until the combine)
            alloc(r * 2 * F * b)
            kept += r * 2 * F * b
            alloc(r * F * b)
            alloc(r * H * b)
            free(r * F * b)
        free(r * H * b * (1 + u))  # y of both, after the combine
    alloc(A * H * b)  # the expert outputs kept for the weights' gradient
    kept += A * H * b
    alloc(T * H * b)  # y
    free(T * H * b)  # (the caller's)
    # backward
    alloc(T * k * 4)  # grad of the top-k weights (fp32)
    dgrad = 0
    for r in regions:
        for _ in range(1 + u):
            alloc(r * F * b)  # grad of the activation
            alloc(r * 2 * F * b)  # grad of h (kept for the weight gradients)
            free(r * F * b)
            alloc(r * H * b)  # grad of the received rows, until the combine
            dgrad += r * 2 * F * b
        free(r * H * b * (1 + u))
    if weight_grads:
        if u:
            alloc(N * expert)  # the slots' weight gradients
        for r in regions:
            alloc(r * F * b)  # the activation, recomputed for fc2's gradient
            free(r * F * b)
        alloc(E_loc * expert)  # the main experts' weight gradients
    free(dgrad)
    alloc(T * H * b)  # grad x
    return LayerMemory(buffers=buffers, slots=slots, kept=kept, peak=peak)
