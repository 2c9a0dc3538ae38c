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
                 weight_grads: bool = True, topk_weights_grad: bool = True) -> LayerMemory:
    """The memory of one backend cuda layer call on one rank (module docstring), when no row spills.

    tokens: this call's T; max_tokens: the workspace's (default T). slots_used: the call runs the replica machinery
    (a balancing plan, or the capacity step placed a replica; False when the guard's hint left it out: the slot
    region's tensors are not made). weight_grads: the expert weights' gradients are new tensors of the call (the
    layer's own parameters with no gradient yet, as bench/layer_memory.py measures). topk_weights_grad: the top-k
    weights need a gradient (a router's do), so the expert outputs are kept for it. The call's output counts as
    the call's: its caller holds it through the backward. chunks > 1 run dispatch and combine on the comm stream,
    so every chunk's expert outputs (forward) and row gradients (backward) stay until its join."""
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

    # the caching allocator, in the order of cuda_function.CudaExpertParallelFunction
    live, peak = 0, 0

    def alloc(n):
        nonlocal live, peak
        live += n
        peak = max(peak, live)

    def free(n):
        nonlocal live
        live -= n

    u = bool(N and slots_used)
    groups = 1 + u  # the main experts' region, and the slots' when they are used
    joined = chunks > 1  # the comm stream: outputs and row gradients stay until the join
    alloc(T * k * b)  # wq
    kept = T * k * b
    for r in regions:  # forward, chunk by chunk
        alloc(groups * r * H * b)  # xm, xs: copies of the received rows (kept)
        kept += groups * r * H * b
        for _ in range(groups):  # main, then slot GEMMs: h (kept), act (freed), y (until the combine)
            alloc(r * 2 * F * b)
            kept += r * 2 * F * b
            alloc(r * F * b)
            alloc(r * H * b)
            free(r * F * b)
        if not joined:
            free(groups * r * H * b)  # both outputs, after the chunk's combine
    if joined:
        free(groups * rows * H * b)
    if topk_weights_grad:
        alloc(A * H * b)  # the expert outputs kept for the weights' gradient
        kept += A * H * b
    alloc(T * H * b)  # y: the caller's, held through the backward
    # backward
    if topk_weights_grad:
        alloc(T * k * 4)  # the top-k weights' gradient (fp32, then in their dtype)
        alloc(T * k * b)
        free(T * k * 4)
    dgrad = 0
    for r in regions:
        for _ in range(groups):  # main, then slots; the row gradients of both stay until the chunk's combine
            alloc(r * F * b)  # grad of the activation
            alloc(r * 2 * F * b)  # grad of h (kept for the weight gradients)
            free(r * F * b)
            alloc(r * H * b)  # grad of the received rows
            dgrad += r * 2 * F * b
        if not joined:
            free(groups * r * H * b)
    if weight_grads:
        for G in ([N] if u else []) + [E_loc]:  # the slots' (kept while they travel home), then the main experts'
            for r in regions:  # per chunk: g1, the activation recomputed for g2, g2; then the chunks summed
                alloc(G * 2 * F * H * b)
                alloc(r * F * b)
                alloc(G * F * H * b)
                free(r * F * b)
            free((len(regions) - 1) * G * expert)
    if joined:
        free(groups * rows * H * b)  # the row gradients, at the comm stream's join
    alloc(T * H * b)  # grad x
    return LayerMemory(buffers=buffers, slots=slots, kept=kept, peak=peak)
