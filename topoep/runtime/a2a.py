"""Backend `cuda`'s transport between ranks that need not share an NVLink domain (transport="a2a"): token
rows, replica weights and replica gradients move with all-to-alls whose split sizes stay on the device.

On GPUs the all-to-all is torch's NVSHMEM op `symm_mem.all_to_all_vdev` (NVLink inside a node, the NIC
between nodes; `NvshmemExchange`); the CPU tests run the same code over gloo with host splits
(`GlooExchange`). `A2AWorkspace` and `A2AReplicaPool` have the interface of `symm.SymmWorkspace` and
`symm.SymmReplicaPool`, whose peer-pointer kernels only reach the ranks of one host, so the layer
(cuda_function.py) runs unchanged on either transport.

Every size the host sees is fixed by the shapes (worst-case buffers, cap = R * A_cap rows), so nothing
reads a count on the host. torch's op pulls each peer's rows with B blocks (the exchange's blocks_per_peer)
and needs each peer's bytes to divide over them, so every split is padded to a multiple of B rows (padding
rows carry metadata that sends them to a spare row) and every weight row to a multiple of 8 B elements.
Where a row lands is decided by data that travels with it or that every rank already has:
    dispatch    rows go in send order (destination-major: the layout's sort, each destination's run
                padded to B rows), with int64 metadata (source, pos, slot) beside them; the receiver
                copies each row to `pos` of its main or slot buffer (the group-major layout of
                layout.receive_positions). Rows arrive packed in source order, and rows that did not
                arrive keep metadata -1.
    combine     each receiver sends the results back in the order the rows arrived, split by source,
                so every source gets its rows back in its own send order: out[order[i]] = row i.
    fetch       the main rank sends its expert's weights to every slot that replicates it, in (rank,
                slot) order; the plan is the same on every rank, so the receiver knows which row is
                which slot.
    grad return each slot sends its weight gradient to its expert's main rank; the main rank sums them
                in (source, slot) order in fp32 as one 0/1 matrix product (deterministic), touching
                only the experts that have replicas (at most R N of them).
The worst-case buffers of the replica transfers hold 2 R N + 2 N expert weights per rank (a main rank may
feed every slot of the group, and receive every slot's gradient): about 340 MB at EP 8 with 2 slots for the
Qwen3 expert shape.

With a capacity (regions smaller than their worst case, so rows may spill: spill.py) only the CPU harness's gloo
exchange is supported: it stages spilled rows like the peer-pointer workspace and emulates the destination's reads
of the sources' staging with collectives (an all-gather of the staging, an all-to-all of the results), and computes
them with spill.py's torch references. The NVSHMEM exchange refuses a capacity: reading a source's staging across
hosts needs NVSHMEM gets in the spill kernels, which no machine here can run (transport a2a runs with
capacity_factor=None, its buffers sized for the worst case).

Known limits: the gradient return's 0/1 matrix product turns one slot's NaN into NaN for every replicated
expert of that main rank (the step is lost either way); the exchange and the buffers are collective allocations
made at the first forward, so every rank must run its MoE layers in step (no pipeline parallelism yet:
app/config.py refuses transport a2a with pp > 1).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from topoep.relay import chunk_range, step_chunk
from topoep.runtime.layout import count_keys
from topoep.runtime.pool import SlotBanks


class GlooExchange:
    """The all-to-all over torch.distributed with host split sizes (gloo; the CPU tests)."""

    def __init__(self, group=None, device="cpu", blocks_per_peer: int = 1):
        self.group = group
        self.R, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.device = torch.device(device)
        self.blocks_per_peer = blocks_per_peer  # checked as torch's NVSHMEM op asserts it (tests)

    _shared: dict = {}

    @classmethod
    def shared(cls, group=None):
        """One exchange per group in the process (backend cuda's transport 'gloo': every layer's workspace and
        pool use it, as with NvshmemExchange.shared)."""
        key = (group or dist.group.WORLD).group_name
        if key not in cls._shared:
            cls._shared[key] = cls(group)
        return cls._shared[key]

    def buffer(self, shape, dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def all_to_all(self, send: torch.Tensor, recv: torch.Tensor, in_splits: torch.Tensor) -> None:
        """Rows send[:sum(in_splits)] (destination-major, in_splits[d] for rank d) -> recv, packed in
        source order from row 0; recv's later rows keep their contents."""
        ins = in_splits.to(torch.int64).cpu()
        row_bytes = send[0].numel() * send.element_size()
        if any(n * row_bytes % self.blocks_per_peer for n in ins.tolist()):
            raise AssertionError(f"splits {ins.tolist()} x {row_bytes} bytes do not divide over "
                                 f"{self.blocks_per_peer} blocks per peer")
        outs = torch.empty_like(ins)
        dist.all_to_all_single(outs, ins, group=self.group)
        ins, outs = ins.tolist(), outs.tolist()
        dist.all_to_all_single(recv[:sum(outs)], send[:sum(ins)].contiguous(), outs, ins, group=self.group)

    def all_gather(self, row: torch.Tensor) -> torch.Tensor:
        out = [torch.empty_like(row) for _ in range(self.R)]
        dist.all_gather(out, row.contiguous(), group=self.group)
        return torch.stack(out)


class NvshmemExchange:
    """The all-to-all as torch's NVSHMEM op (split sizes on the device; no host synchronisation). The
    process's symmetric memory must use the NVSHMEM backend, chosen before its first allocation.

    What torch 2.11's op needs (read from its source): every tensor symmetric; each rank first writes
    its split and source offset into every peer's out_splits_offsets, passes a team barrier, then pulls
    its rows and rewrites its own offsets row, with no barrier after. So consecutive calls alternate
    between two out_splits_offsets buffers: a peer can write into the one of call k + 2 only after the
    barrier of call k + 1, which this rank reaches after finishing call k. (The handle's barrier() is a
    no-op on NVSHMEM in 2.11; it cannot order the calls.) And the op splits each peer's bytes evenly
    over its blocks (TORCH_SYMMMEM_NBLOCKS / R of them, read once per process) and asserts they divide:
    the workspace and pool pad to `blocks_per_peer`. Default 64 blocks in all (torch's choice for large
    messages inside a node; across nodes torch caps its own choice at 16, which a set variable overrides:
    set TORCH_SYMMMEM_NBLOCKS to a multiple of the EP size to tune it), at least one per peer. Creating the exchange is collective (NVSHMEM initialises over all
    ranks)."""

    def __init__(self, group=None, device="cuda"):
        import os

        from torch.distributed import _symmetric_memory as symm_mem

        self._symm = symm_mem
        if not symm_mem.is_nvshmem_available():
            raise ValueError("transport 'a2a' needs NVSHMEM (nvidia-nvshmem-cu13 with torch's NVSHMEM build); "
                             "use transport='peer' on one host")
        self.group = group or dist.group.WORLD
        self.group_name = self.group.group_name
        self.R, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        nblocks = int(os.environ.setdefault("TORCH_SYMMMEM_NBLOCKS", str(self.R * max(1, 64 // self.R))))
        if nblocks < self.R or nblocks % self.R:
            raise ValueError(f"TORCH_SYMMMEM_NBLOCKS={nblocks}: transport 'a2a' needs a multiple of the EP size "
                             f"{self.R} (the blocks per peer of torch's all-to-all); unset it for the default")
        self.blocks_per_peer = nblocks // self.R
        try:
            symm_mem.set_backend("NVSHMEM")
        except RuntimeError as err:
            raise ValueError(f"transport 'a2a' could not put symmetric memory on NVSHMEM ({err}); it must be chosen "
                             "before the process's first symmetric allocation: use one transport per process") from err
        self.device = torch.device(device)
        self._handles = []
        self._splits = self.buffer((self.R,), torch.int64)
        self._splits_offsets = [self.buffer((2, self.R), torch.int64) for _ in range(2)]
        self._calls = 0

    _shared: dict = {}

    @classmethod
    def shared(cls, group, device):
        """One exchange per (group, device) in the process: every layer's workspace and pool use it."""
        key = ((group or dist.group.WORLD).group_name, torch.device(device))
        if key not in cls._shared:
            cls._shared[key] = cls(group, device)
        return cls._shared[key]

    def buffer(self, shape, dtype) -> torch.Tensor:
        t = self._symm.empty(*shape, dtype=dtype, device=self.device)
        t.zero_()
        self._handles.append(self._symm.rendezvous(t, self.group_name))
        return t

    def all_to_all(self, send: torch.Tensor, recv: torch.Tensor, in_splits: torch.Tensor) -> None:
        self._splits.copy_(in_splits)
        offsets = self._splits_offsets[self._calls % 2]  # every rank makes the same calls in the same order
        self._calls += 1
        torch.ops.symm_mem.all_to_all_vdev(send, recv, self._splits, offsets, self.group_name)

    def all_gather(self, row: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.R * row.numel(), dtype=row.dtype, device=row.device)
        dist.all_gather_into_tensor(out, row.contiguous().view(-1), group=self.group)
        return out.view(self.R, row.numel())


class A2AWorkspace:
    """`symm.SymmWorkspace`'s operations over an exchange (module docstring). One per (exchange, sizes),
    shared by every layer; creating one is collective on GPUs."""

    _shared: dict = {}

    def __init__(self, exchange, num_groups: int, experts_per_rank: int, a_cap: int, hidden: int, dtype,
                 regions: tuple[int, ...] | None = None, spills: bool = False):
        ex = self.exchange = exchange
        self.R, self.rank, self.device = ex.R, ex.rank, ex.device
        self.G, self.e_loc, self.a_cap, self.H = num_groups, experts_per_rank, a_cap, hidden
        # the layout's receive rows (positions of layout.receive_positions): a region per chunk (symm.SymmWorkspace)
        self.regions = tuple(regions) if regions is not None else (self.R * a_cap,)
        self.cap = sum(self.regions)
        self.spills = spills  # a region smaller than its worst case: rows may spill
        if self.spills and not isinstance(ex, GlooExchange):
            raise ValueError("transport 'a2a' (NVSHMEM) sizes its buffers for the worst case: a capacity needs the peer "
                             "transport (one host) or the CPU harness; set capacity_factor=None "
                             "(eplb.capacity_factor=null) with transport a2a")
        if self.spills:  # the sources' staging of spilled rows (spill.py), and the spill results to apply
            self.stage = torch.zeros(a_cap, hidden, dtype=dtype, device=self.device)
            self.stage2 = torch.zeros(a_cap, hidden, dtype=dtype, device=self.device)
            self.stage_meta = torch.zeros(a_cap, dtype=torch.int64, device=self.device)
        self.spilled_rows = torch.zeros(1, dtype=torch.int64, device=self.device)  # received on the spill path
        self._spilled = None  # (assignment indices, rows) that the spill path computed for this rank's next combine
        self._staged = None  # the gathered staging of the last backward spill, for its weight gradients
        self.B = B = ex.blocks_per_peer
        s_cap, r_cap = a_cap + self.R * (B - 1), self.R * (a_cap + B - 1)  # with each split padded to B rows
        self.send, self.recv = ex.buffer((s_cap, hidden), dtype), ex.buffer((r_cap, hidden), dtype)
        self.meta_send, self.meta_recv = ex.buffer((s_cap,), torch.int64), ex.buffer((r_cap,), torch.int64)
        self.back_send, self.back_recv = ex.buffer((r_cap, hidden), dtype), ex.buffer((s_cap, hidden), dtype)
        # the receive buffers in the layer's layout, with one spare row that takes padding rows
        self.recv_main = torch.zeros(self.cap + 1, hidden, dtype=dtype, device=self.device)
        has_slots = num_groups > experts_per_rank
        self.recv_slot = torch.zeros(self.cap + 1, hidden, dtype=dtype, device=self.device) if has_slots else None
        self.overflow = torch.zeros(1, dtype=torch.int32, device=self.device)  # rows are checked on the host
        self._pad_meta = (self.rank * (self.cap + 1) + self.cap) << 1  # a padding row: from me, to the spare row
        self._arrived = None  # (is_slot, pos, source; R where nothing arrived) of the last dispatch's rows
        self._order = self._send_pos = None

    @classmethod
    def shared(cls, exchange, num_groups, experts_per_rank, a_cap, hidden, dtype, regions=None, spills=False):
        key = (id(exchange), num_groups, experts_per_rank, a_cap, hidden, dtype,
               tuple(regions) if regions is not None else None, spills)
        ws = cls._shared.get(key)
        if ws is None:
            ws = cls._shared[key] = cls(exchange, num_groups, experts_per_rank, a_cap, hidden, dtype, regions, spills)
        return ws

    @property
    def nbytes(self) -> int:
        """Bytes of this workspace's buffers."""
        ts = [self.send, self.recv, self.meta_send, self.meta_recv, self.back_send, self.back_recv, self.recv_main,
              self.recv_slot] + ([self.stage, self.stage2, self.stage_meta] if self.spills else [])
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def all_gather(self, row: torch.Tensor, which: int) -> torch.Tensor:
        """int64[n] on every rank -> int64[R, n] (`which` only matters to the peer-pointer workspace)."""
        return self.exchange.all_gather(row)

    def dispatch(self, src: torch.Tensor, order: torch.Tensor, row_div: int, dest: torch.Tensor, pos: torch.Tensor,
                 is_slot: torch.Tensor, join=None, scale: torch.Tensor | None = None, region_end: int | None = None,
                 stage_base: int = 0, src2: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Send row i (src[order[i] // row_div], times scale[order[i]] when scale is given: one fp32 product
        rounded to src's type) to row pos[i] of rank dest[i]'s main or slot buffer; `dest` ascends (the send
        order). A row at or beyond region_end is staged here instead (stage_base + i; src2's row beside it: the
        spill path) and travels as padding. Returns this rank's (recv_main, recv_slot) [cap, H]; rows past the
        received counts are stale. join: an event to wait for first (the a2a pool fetches in order, so the layer
        passes None)."""
        if join is not None:
            torch.cuda.current_stream(src.device).wait_event(join)
        A = order.numel()
        if A > self.a_cap:
            raise ValueError(f"{A} rows to send but the a2a workspace holds {self.a_cap} per rank (max_tokens x "
                             "top_k): pass max_tokens=<the largest T> to ExpertParallelMoE")
        splits = count_keys(dest, self.R)
        padded = (splits + self.B - 1) // self.B * self.B
        # row i's place in the send buffer: its destination's padded start + its index within the destination
        skip = torch.cumsum(padded - splits, 0) - (padded - splits)
        send_pos = torch.arange(A, device=dest.device) + skip.index_select(0, dest)
        rows = src.index_select(0, order // row_div)
        if scale is not None:
            rows = (rows.float() * scale.index_select(0, order).float()[:, None]).to(src.dtype)
        self.send.index_copy_(0, send_pos, rows)
        self.meta_send.fill_(self._pad_meta)
        meta = ((self.rank * (self.cap + 1) + pos) << 1) | is_slot.to(torch.int64)
        if self.spills:
            spill = pos >= (self.cap if region_end is None else region_end)
            at = stage_base + torch.arange(A, device=dest.device)
            self.stage.index_copy_(0, at[spill], rows[spill])
            self.stage_meta.index_copy_(0, at[spill], order[spill])
            if src2 is not None:
                self.stage2.index_copy_(0, at[spill], src2.index_select(0, order[spill] // row_div))
            meta = torch.where(spill, self._pad_meta, meta)  # travels as padding: the receiver drops it
        self.meta_send.index_copy_(0, send_pos, meta)
        self.meta_recv.fill_(-1)
        self.exchange.all_to_all(self.meta_send, self.meta_recv, padded)
        self.exchange.all_to_all(self.send, self.recv, padded)
        m = self.meta_recv
        valid = m >= 0
        slot = (m & 1).bool() & valid
        at = (m.clamp(min=0) >> 1)
        p, source = at % (self.cap + 1), at // (self.cap + 1)
        spare = torch.full_like(p, self.cap)
        self.recv_main.index_copy_(0, torch.where(valid & ~slot, p, spare), self.recv)
        if self.recv_slot is not None:
            self.recv_slot.index_copy_(0, torch.where(slot, p, spare), self.recv)
        self._arrived = (slot, p.clamp(max=self.cap - 1), torch.where(valid, source, self.R))
        self._order, self._send_pos = order, send_pos
        return self.recv_main[:self.cap], (self.recv_slot[:self.cap] if self.recv_slot is not None else None)

    def combine(self, y_main: torch.Tensor, y_slot: torch.Tensor | None, n_main: torch.Tensor,
                n_slot: torch.Tensor | None, num_rows: int, copy: bool = True, base: int = 0,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """The reverse of the last dispatch: row pos of the main / slot results goes back to the source
        that sent it, at its assignment index. base: the first row of the last dispatch's region (y_main and
        y_slot hold that region). Returns a new [num_rows, H] tensor, or `out` with these rows written into it
        (a chunk's; `copy` is the peer workspace's switch)."""
        slot, p, source = self._arrived
        p = (p - base).clamp(0, y_main.shape[0] - 1)  # rows that did not arrive (padding) are not used
        rows = y_main.index_select(0, p)
        if y_slot is not None:
            rows = torch.where(slot[:, None], y_slot.index_select(0, p), rows)
        self.back_send.copy_(rows)
        # every arrived row goes back, padding included, so each source gets its padded send layout back
        self.exchange.all_to_all(self.back_send, self.back_recv, count_keys(source, self.R + 1)[:self.R])
        if out is None:
            out = y_main.new_empty(num_rows, y_main.shape[1])
        out.index_copy_(0, self._order, self.back_recv.index_select(0, self._send_pos))
        if self._spilled is not None:  # the spilled rows' results (spill), at their assignment indices
            out.index_copy_(0, *self._spilled)
            self._spilled = None
        return out

    # -- the spill path (gloo exchange only: __init__) --------------------------------------------------------------
    def _gather_staging(self, backward: bool):
        """Every rank's staging: (inputs [R, A_cap, H], output gradients or None, assignment indices [R, A_cap])."""
        ex = self.exchange
        xs = ex.all_gather(self.stage2 if backward else self.stage)
        gs = ex.all_gather(self.stage) if backward else None
        return xs, gs, ex.all_gather(self.stage_meta)

    def _weights(self, g: int, main: tuple, slot: tuple | None):
        """Local group g's pair of tensors: main[.][g] for a main expert, slot[.][g - E_loc] for a replica slot."""
        return (main[0][g], main[1][g]) if g < self.e_loc else (slot[0][g - self.e_loc], slot[1][g - self.e_loc])

    def spill(self, work, main: tuple, slot: tuple | None, backward: bool = False) -> None:
        """symm.SymmWorkspace.spill over the gloo exchange (host reads: the CPU harness): the rows spilled to this
        rank, read from every rank's gathered staging, computed with spill.py's torch references; their results go
        back to their sources, which put them at their assignment indices in their next combine."""
        if not self.spills:
            return
        from topoep.runtime.spill import spill_backward_reference, spill_forward_reference

        xs, gs, metas = self._gather_staging(backward)
        if backward:
            self._staged = (xs, gs)
        else:
            self.spilled_rows += work.rows
        n, first = work.n.tolist(), work.first.tolist()
        out = [[] for _ in range(self.R)]  # per source: (assignment indices, rows)
        for s in range(self.R):
            for g in range(self.G):
                if n[s][g]:
                    i = slice(first[s][g], first[s][g] + n[s][g])
                    w1, w2 = self._weights(g, main, slot)
                    y = (spill_backward_reference(xs[s][i], gs[s][i], w1, w2)[0] if backward
                         else spill_forward_reference(xs[s][i], w1, w2))
                    out[s].append((metas[s][i], y))
        sizes = [sum(len(a) for a, _ in o) for o in out]
        send_a = torch.cat([a for o in out for a, _ in o] or [metas.new_zeros(0)])
        send_y = torch.cat([y for o in out for _, y in o] or [xs.new_zeros(0, self.H)])
        got = torch.tensor(sizes, dtype=torch.int64)
        recv_sizes = torch.empty_like(got)
        dist.all_to_all_single(recv_sizes, got, group=self.exchange.group)
        rs = recv_sizes.tolist()
        recv_a = send_a.new_empty(sum(rs))
        recv_y = send_y.new_empty(sum(rs), self.H)
        dist.all_to_all_single(recv_a, send_a, rs, sizes, group=self.exchange.group)
        dist.all_to_all_single(recv_y, send_y, rs, sizes, group=self.exchange.group)
        self._spilled = (recv_a, recv_y)

    def spill_wgrad(self, work, main: tuple, main_grads: tuple, groups: tuple[int, int], slot: tuple | None = None,
                    slot_grads: tuple | None = None) -> None:
        """symm.SymmWorkspace.spill_wgrad over the staging gathered by the last backward spill."""
        if not self.spills:
            return
        from topoep.runtime.spill import spill_backward_reference

        xs, gs = self._staged
        n, first = work.n.tolist(), work.first.tolist()
        for g in range(*groups):
            sources = [s for s in range(self.R) if n[s][g]]
            if not sources:
                continue
            w1, w2 = self._weights(g, main, slot)
            d1, d2 = self._weights(g, main_grads, slot_grads)
            a1, a2 = torch.zeros(d1.shape), torch.zeros(d2.shape)
            for s in sources:  # fp32 sums in source order, one rounding (as the kernel)
                i = slice(first[s][g], first[s][g] + n[s][g])
                _, b1, b2 = spill_backward_reference(xs[s][i], gs[s][i], w1, w2)
                a1 += b1
                a2 += b2
            d1.copy_((d1.float() + a1).to(d1.dtype))
            d2.copy_((d2.float() + a2).to(d2.dtype))

    def copy_rows(self, src: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        """A copy of src that later dispatches do not overwrite (rows past n are stale either way)."""
        return src.clone()


def _owner(se: torch.Tensor, e_loc: int) -> torch.Tensor:
    """Main rank of each slot's expert; -1 for an empty slot."""
    return torch.where(se >= 0, se.div(e_loc, rounding_mode="floor"), -1)


class A2AReplicaPool(SlotBanks):
    """`symm.SymmReplicaPool`'s operations over an exchange: per bank b (`pool.SlotBanks`), `bank_weights(b)`
    = slots fc1 [N, 2F, H], fc2 [N, H, F]. Its fetch is a collective, so the layer runs it on its own stream."""

    _shared: dict = {}

    def __init__(self, exchange, num_slots: int, hidden_size: int, ffn_hidden_size: int, dtype, banks: int = 1):
        self.init_banks(banks)
        ex = self.exchange = exchange
        self.R, self.rank, self.num_slots = ex.R, ex.rank, num_slots
        H, F, N, RN = hidden_size, ffn_hidden_size, num_slots, ex.R * num_slots
        self._banked = (torch.zeros(banks, N, 2 * F, H, dtype=dtype, device=ex.device),
                        torch.zeros(banks, N, H, F, dtype=dtype, device=ex.device))
        self.fc1, self.fc2 = self.bank_weights(0)
        step = 8 * ex.blocks_per_peer  # a weight row's length: whole 8-element pieces for every block of the op
        cols = [-(-w[0].numel() // step) * step for w in (self.fc1, self.fc2)]
        self._bufs = [dict(send=ex.buffer((RN, c), dtype), recv=ex.buffer((N, c), dtype),
                           gsend=ex.buffer((N, c), dtype), grecv=ex.buffer((RN, c), dtype)) for c in cols]

    @classmethod
    def shared(cls, exchange, num_slots, hidden_size, ffn_hidden_size, dtype, banks: int = 1):
        key = (id(exchange), num_slots, hidden_size, ffn_hidden_size, dtype, banks)
        pool = cls._shared.get(key)
        if pool is None:
            pool = cls._shared[key] = cls(exchange, num_slots, hidden_size, ffn_hidden_size, dtype, banks)
        return pool

    @property
    def nbytes(self) -> int:
        """The slots and the exchange buffers of the replica transfers."""
        return sum(t.numel() * t.element_size() for t in (*self._banked, *(v for b in self._bufs for v in b.values())))

    def _trees(self, se: torch.Tensor, e_loc: int, relay):
        """(source, level, levels) of every slot's transfer: from its main rank at level 1, or the relay trees."""
        if relay is not None and relay.schedule != "levels":
            raise ValueError(f"the a2a transport runs relay trees level by level (its all-to-alls), not "
                             f"{relay.schedule!r}: use relay_schedule 'levels', or transport 'peer' on one host")
        if relay is None:
            return _owner(se, e_loc), (se >= 0).to(torch.int64), 1
        return relay.source.reshape(-1), relay.level.reshape(-1), relay.levels

    def _held(self, se: torch.Tensor) -> torch.Tensor:
        """For every slot of the group: the slot of this rank that holds its expert (0 where none does)."""
        se_me = se.view(self.R, self.num_slots)[self.rank]
        return ((se[:, None] == se_me[None, :]) & (se_me >= 0)[None, :]).to(torch.int32).argmax(1)

    def _chunked(self, b: dict, n: int, chunks: int) -> dict:
        """The exchange buffers b as rows of one chunk: views of their first elements, the chunk's width rounded up
        to the exchange's pieces, at most the full row."""
        if chunks == 1:
            return b
        piece = 8 * self.exchange.blocks_per_peer
        w = min(b["send"].shape[1], -(-(-(-n // chunks)) // piece) * piece)
        return {k: v.view(-1)[:v.shape[0] * w].view(v.shape[0], w) for k, v in b.items()}

    def fetch(self, slot_expert: torch.Tensor, W1: torch.Tensor, W2: torch.Tensor, e_loc: int, bank: int = 0,
              relay=None) -> None:
        """Every main rank sends the weights of its replicated experts (W1 [E_loc, 2F, H], W2 [E_loc, H, F])
        to the slots of `bank` the plan gives them; with `relay` (topoep.relay.RelayTrees) every slot's copy comes
        from its source, one all-to-all per step of topoep.relay.relay_steps (relay.chunks chunks per copy; one
        chunk: a step per level; a relay sends from its own slot, whose chunk arrived in an earlier step)."""
        R, N, me = self.R, self.num_slots, self.rank
        se = slot_expert.reshape(-1)
        source, level, levels = self._trees(se, e_loc, relay)
        C = relay.chunks if relay is not None else 1
        f = torch.arange(R * N, device=se.device)
        j = torch.arange(N, device=se.device)
        home = _owner(se, e_loc) == me
        local = (se - me * e_loc).clamp(0, e_loc - 1)
        held = self._held(se) if relay is not None else None
        my_level = level.view(R, N)[me]
        for step in range(levels + C - 1):
            active = [(lv, c) for lv in range(1, levels + 1) if (c := step_chunk(step, lv, C)) is not None]
            on = _levels_in(level, active)
            mine = (source == me) & on
            send_order = torch.argsort(torch.where(mine, f, R * N + f), stable=True)  # mine first, (rank, slot) order
            splits = count_keys(torch.where(mine, f // N, R), R + 1)[:R]
            # my slot j's row: rows come in (source rank, slot) order, from the slots of this step
            here = _levels_in(my_level, active)
            key = torch.where(here, source.view(R, N)[me] * N + j, R * N + j)
            row_of = torch.argsort(torch.argsort(key, stable=True), stable=True)
            sent_level = level.index_select(0, send_order)
            sent_local = local.index_select(0, send_order)
            if relay is not None:
                sent_home, sent_held = home.index_select(0, send_order)[:, None], held.index_select(0, send_order)
            for W, slots, full in zip((W1, W2), self.bank_weights(bank), self._bufs):
                n = slots[0].numel()
                b = self._chunked(full, n, C)
                for lv, c in active:  # each level's chunk of its rows (only those columns are read)
                    lo, hi = chunk_range(n, C, c)
                    rows = W.reshape(e_loc, -1)[:, lo:hi].index_select(0, sent_local)
                    if relay is not None:  # a relay's rows come from its slots
                        rows = torch.where(sent_home, rows, slots.reshape(N, -1)[:, lo:hi].index_select(0, sent_held))
                    if len(active) > 1:
                        rows = torch.where((sent_level == lv)[:, None], rows, b["send"][:, :hi - lo])
                    b["send"][:, :hi - lo].copy_(rows)
                self.exchange.all_to_all(b["send"], b["recv"], splits)
                got = b["recv"].index_select(0, row_of)
                flat = slots.view(N, -1)
                for lv, c in active:
                    lo, hi = chunk_range(n, C, c)
                    take = here & (my_level == lv) if relay is not None else None
                    flat[:, lo:hi].copy_(got[:, :hi - lo] if take is None else
                                         torch.where(take[:, None], got[:, :hi - lo], flat[:, lo:hi]))

    def publish(self) -> None:
        """Nothing to do: the fetch is a collective on the layer's stream, ordered with everything else."""

    def return_grads(self, slot_expert: torch.Tensor, grad1: torch.Tensor, grad2: torch.Tensor, e_loc: int,
                     src: tuple[torch.Tensor, torch.Tensor], relay=None) -> None:
        """The slots' weight gradients src = (fc1 grads [N, 2F, H], fc2 grads [N, H, F]) go to their expert's
        main rank, which adds them to grad1 [E_loc, 2F, H] / grad2 [E_loc, H, F], summed in (source rank, slot)
        order in fp32. With `relay` (topoep.relay.RelayTrees) up the relay trees, deepest level first, one
        all-to-all per step (relay.chunks chunks per copy, the fetch's steps with the levels reversed): a slot of
        level l sends to the rank it fetched from, which adds what its children sent to its own slot's gradient
        (in src, in place) before its level sends that chunk on. The slots keep their weights."""
        R, N, me = self.R, self.num_slots, self.rank
        se = slot_expert.reshape(-1)
        source, level, levels = self._trees(se, e_loc, relay)
        C = relay.chunks if relay is not None else 1
        j = torch.arange(N, device=se.device)
        accs = tuple(s.reshape(N, -1) for s in src)
        if relay is not None and not all(a.data_ptr() == s.data_ptr() and s.is_contiguous() for a, s in zip(accs, src)):
            raise ValueError("return_grads with relays adds the children's gradients into src in place: pass "
                             "contiguous tensors")
        held = self._held(se).to(torch.int64) if relay is not None else None
        my_level = level.view(R, N)[me]
        for step in range(levels + C - 1):
            active = [(lv, c) for lv in range(levels, 0, -1) if (c := step_chunk(step, levels + 1 - lv, C)) is not None]
            dest = torch.where(_levels_in(my_level, active), source.view(R, N)[me], -1)
            send_order = torch.argsort(torch.where(dest >= 0, dest * N + j, R * N + j), stable=True)
            splits = count_keys(torch.where(dest >= 0, dest, R), R + 1)[:R]
            sent_level = my_level.index_select(0, send_order)
            # what arrives: the gradients of this step's slots that fetched from me, in (source, slot) order; each
            # goes to my main expert (level 1: I am their home) or to my slot holding it (a relay)
            owned = (source == me) & _levels_in(level, active)
            for acc, grad, full in zip(accs, (grad1.view(e_loc, -1), grad2.view(e_loc, -1)), self._bufs):
                n = acc.shape[1]
                b = self._chunked(full, n, C)
                for lv, c in active:
                    lo, hi = chunk_range(n, C, c)
                    rows = acc[:, lo:hi].index_select(0, send_order)
                    if len(active) > 1:
                        rows = torch.where((sent_level == lv)[:, None], rows, b["gsend"][:, :hi - lo])
                    b["gsend"][:, :hi - lo].copy_(rows)
                self.exchange.all_to_all(b["gsend"], b["grecv"], splits)
                for lv, c in active:
                    lo, hi = chunk_range(n, C, c)
                    if lv == 1:
                        targets, count, g = se - me * e_loc, e_loc, grad
                    else:
                        targets, count, g = held, N, acc
                    if len(active) > 1:  # only the rows of this level
                        targets = torch.where(level == lv, targets, count)
                    _add_rows(g[:, lo:hi], b["grecv"][:, :hi - lo], owned, targets, count)


def _levels_in(level: torch.Tensor, active: list) -> torch.Tensor:
    """bool, level's shape: the entries whose level is one of `active`'s (level, chunk) pairs."""
    on = torch.zeros_like(level, dtype=torch.bool)
    for lv, _ in active:
        on |= level == lv
    return on


def _add_rows(g: torch.Tensor, got: torch.Tensor, owned: torch.Tensor, targets: torch.Tensor, count: int) -> None:
    """g [count, n] += the received rows got [R N, n]: received row k is the k-th of the flags `owned` (bool[R N], in
    (source, slot) order), and goes to row targets[that flag's index]; the rows of one target are summed in arrival
    order in fp32, rounded once, as one 0/1 matrix product (deterministic), touching only the targets that receive."""
    RN = owned.numel()
    dev = owned.device
    # received row k's target is tk[k] (count: no row). The targets, distinct and ascending, are L[:n]; L's other
    # entries repeat L[0] with M's row 0, so duplicate writes below carry the same values.
    k = torch.cumsum(owned.to(torch.int64), 0) - 1
    f = torch.arange(RN, device=dev)
    tk = torch.full((RN + 1,), count, dtype=torch.int64, device=dev)
    tk.index_copy_(0, torch.where(owned, k, RN), torch.where(owned, targets, count))
    tk = tk[:RN]
    st = torch.sort(tk).values
    new = (st < count) & torch.cat([st.new_ones(1, dtype=torch.bool), st[1:] != st[:-1]])
    L = torch.full((RN + 1,), count, dtype=torch.int64, device=dev)
    L.index_copy_(0, torch.where(new, torch.cumsum(new.to(torch.int64), 0) - 1, RN), st)
    L = torch.where(f < new.sum(), L[:RN], L[0])
    M = ((tk[None, :] == L[:, None]) & (tk[None, :] < count)).to(torch.float32)  # [R N targets, R N rows]
    rows = L.clamp(max=count - 1)
    got = torch.where((f < owned.sum())[:, None], got, 0)
    n = g.shape[1]
    step = max(1, (1 << 26) // max(1, RN))  # fp32 columns per product: bounded temporaries
    for c in range(0, n, step):  # accumulated in fp32, rounded once (as symm.py)
        cur = g[:, c:c + step].index_select(0, rows).float() + M @ got[:, c:c + step].float()
        g[:, c:c + step].index_copy_(0, rows, cur.to(g.dtype))
