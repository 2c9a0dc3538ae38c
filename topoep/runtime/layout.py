"""Where every token-expert assignment of this rank goes under a plan, and the send/receive orders of
dispatch and combine. Pure tensor code (no collectives), all metadata int64: routing ids never travel
inside the activation rows, so they stay exact at any number of instances (bf16 is exact only to 256).

Vocabulary: an *assignment* is one (token t, choice j) of topk_idx[T, k], numbered a = t * k + j.
On every rank the *local groups* are its E_loc = E / R main experts (group i = expert r * E_loc + i)
followed by its N replica slots (group E_loc + j = slot j); G = E_loc + N.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from topoep.plan import Plan
from topoep.planners.common import group_exclusive_cumsum


def assignment_instances(topk_idx: torch.Tensor, plan: Plan, rank: int) -> torch.Tensor:
    """int64[T * k]: the physical instance p executing each assignment of source `rank`.

    The assignments of one expert e, in assignment order, are split over e's instances in instance
    order, plan.route[rank, p] at a time (the contract of `topoep.plan`)."""
    return _instances(topk_idx, plan, rank)[0]


def assignment_ordinals(e: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """int64[A]: the position of each assignment among this rank's assignments of the same expert, in
    assignment order; counts: int64[E], the assignments of each expert (this rank's row of omega). What
    planners.common.rank_within_group computes for any groups, here for ids in [0, E) with known counts:
    one stable sort of 32-bit keys instead of an argsort of 64-bit group * A + index keys."""
    A = e.numel()
    sorted_e, idx = torch.sort(e.to(torch.int32), stable=True)
    start = torch.cumsum(counts, 0) - counts
    out = torch.empty_like(e)
    out[idx] = torch.arange(A, device=e.device) - start.index_select(0, sorted_e.to(torch.int64))
    return out


def _instances(topk_idx: torch.Tensor, plan: Plan, rank: int):
    """(instance of each assignment, its ordinal within its expert, first ordinal served by each instance)."""
    e = topk_idx.reshape(-1)
    A = e.numel()
    if A == 0:
        return e.clone(), e.clone(), None
    counts = plan.route[rank]  # [P]
    inst_expert = plan.instance_expert
    start = group_exclusive_cumsum(counts, inst_expert)  # first ordinal served by each instance
    used = (counts > 0) & (inst_expert >= 0)
    big = A + 1
    # unused instances sort after every query (e * big + ordinal < E * big): no nonzero(), no host sync
    inst_key = torch.where(used, inst_expert * big + start, plan.num_experts * big)
    order = torch.argsort(inst_key)
    ordinal = assignment_ordinals(e, plan.omega[rank])  # omega[rank] counts these very assignments
    idx = torch.searchsorted(inst_key[order], e * big + ordinal, right=True) - 1
    return order[idx], ordinal, start


def chunk_route_row(route_row: torch.Tensor, inst_expert: torch.Tensor, counts_first: torch.Tensor) -> torch.Tensor:
    """int64[P]: the part of this rank's route row that serves the first chunk of its assignments, when the
    assignments are split in two at a token boundary; counts_first int64[E]: the first chunk's assignments of
    each expert. The instances of e serve consecutive ordinals of e in instance order (`_instances`), and the
    first chunk holds e's first counts_first[e] ordinals; the rest of the row serves the second chunk."""
    start = group_exclusive_cumsum(route_row, inst_expert)
    n = counts_first.index_select(0, inst_expert.clamp(min=0))
    return torch.where(inst_expert >= 0, torch.minimum((n - start).clamp(min=0), route_row), 0)


def group_counts(plan: Plan) -> torch.Tensor:
    """int64[R, R, G]: C[s, d, g] = rows source s sends to local group g of rank d, read off the plan's
    route (the same on every rank, so no exchange is needed). Assumes the default placement."""
    R, E, N = plan.num_ranks, plan.num_experts, plan.num_slots
    route = plan.route
    return torch.cat([route[:, :E].reshape(R, R, E // R), route[:, E:].reshape(R, R, N)], dim=2)


def send_layout(topk_idx: torch.Tensor, plan: Plan, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(C int64[R, R, G] as `group_counts`, send_key int64[A] ascending, order int64[A]): this rank's
    assignments in send order (by destination * G + group, then assignment index), the same as a stable
    sort of the keys, without one: every (destination, group) key is one instance, which serves
    consecutive ordinals of its expert, so row a goes to the key's start + its ordinal - the instance's
    first ordinal. Assumes the default placement."""
    e = topk_idx.reshape(-1)
    A = e.numel()
    C = group_counts(plan)
    if A == 0:
        return C, e.clone(), e.clone()
    G = C.shape[2]
    inst, ordinal, start = _instances(topk_idx, plan, rank)
    key = plan.instance_rank[inst] * G + local_group(inst, plan)
    mine = C[rank].reshape(-1)
    key_start = torch.cumsum(mine, 0) - mine
    at = key_start.index_select(0, key) + ordinal - start.index_select(0, inst)
    # a permutation only if the plan routes exactly this rank's assignments (C1): checked on the device
    torch._assert_async(mine.sum() == A, "send_layout: the plan's route does not match this rank's assignments")
    order = torch.empty_like(e)
    order[at] = torch.arange(A, device=e.device)
    return C, key.index_select(0, order), order


def count_keys(key: torch.Tensor, n: int) -> torch.Tensor:
    """int64[n]: occurrences of each value of key (values in [0, n)). Unlike torch.bincount on CUDA, this
    never reads the maximum on the host."""
    return torch.zeros(n, dtype=torch.int64, device=key.device).index_add_(0, key.reshape(-1),
                                                                           torch.ones_like(key.reshape(-1)))


def local_group(instance: torch.Tensor, plan: Plan) -> torch.Tensor:
    """int64: the destination-local group of physical instances (module docstring). Assumes the
    default placement main_rank[e] = e // E_loc."""
    E, N = plan.num_experts, plan.num_slots
    E_loc = E // plan.num_ranks
    slot = instance - E
    return torch.where(instance < E, instance % E_loc, E_loc + slot.clamp(min=0) % max(N, 1))


@dataclass
class ChunkLayout:
    """Send and receive orders of one chunk of this rank's assignments.

    send_idx: int64[A_c], assignments in send order (by destination rank, then group, then a);
    send_counts: int64[R] rows to each rank; send_group_counts: int64[R, G];
    recv_group_counts: int64[R, G] rows from each source per local group (after the counts exchange);
    recv_counts: int64[R]; group_order: int64[A_recv], received row -> group-major order (groups
    concatenated, sources in rank order inside a group; made on first use, after `copy_splits_to_host` without
    reading the device again); group_sizes: int64[G].
    send_split, recv_split, group_split: host lists of send_counts, recv_counts and group_sizes, for a
    backend that needs split sizes on the host (`copy_splits_to_host`: one device-to-host copy for all
    chunks instead of one per collective and grouped call).
    """

    send_idx: torch.Tensor
    send_counts: torch.Tensor
    send_group_counts: torch.Tensor
    recv_group_counts: torch.Tensor | None = None
    recv_counts: torch.Tensor | None = None
    _group_order: torch.Tensor | None = None
    group_sizes: torch.Tensor | None = None
    send_split: list[int] | None = None
    recv_split: list[int] | None = None
    group_split: list[int] | None = None

    def set_received(self, recv_group_counts: torch.Tensor) -> None:
        self.recv_group_counts = recv_group_counts
        self.recv_counts = recv_group_counts.sum(1)
        self.group_sizes = recv_group_counts.sum(0)
        self._group_order = None

    @property
    def group_order(self) -> torch.Tensor:
        if self._group_order is None:
            R, G = self.recv_group_counts.shape
            dev = self.recv_group_counts.device
            # the rows' count from the host split where it was copied (repeat_interleave reads it otherwise)
            rows = sum(self.recv_split) if self.recv_split is not None else None
            row_group = torch.repeat_interleave(torch.arange(G, device=dev).repeat(R),
                                                self.recv_group_counts.reshape(-1), output_size=rows)
            self._group_order = torch.argsort(row_group, stable=True)
        return self._group_order


def copy_splits_to_host(chunks: list[ChunkLayout]) -> None:
    """Fill send_split, recv_split and group_split of every (received) chunk with one host copy."""
    flat = torch.cat([torch.cat([c.send_counts, c.recv_counts, c.group_sizes]) for c in chunks]).tolist()
    i = 0
    for c in chunks:
        R, G = c.send_counts.numel(), c.group_sizes.numel()
        c.send_split, c.recv_split, c.group_split = flat[i:i + R], flat[i + R:i + 2 * R], flat[i + 2 * R:i + 2 * R + G]
        i += 2 * R + G


def chunk_layouts(dest_rank: torch.Tensor, dest_group: torch.Tensor, num_tokens: int, top_k: int,
                  num_ranks: int, num_groups: int, num_chunks: int) -> list[ChunkLayout]:
    """Split the assignments into `num_chunks` chunks of consecutive tokens and lay each out for sending."""
    bounds = [num_tokens * c // num_chunks for c in range(num_chunks + 1)]
    out = []
    for c in range(num_chunks):
        a0, a1 = bounds[c] * top_k, bounds[c + 1] * top_k
        key = dest_rank[a0:a1] * num_groups + dest_group[a0:a1]
        order = torch.argsort(key, stable=True)
        gc = count_keys(key, num_ranks * num_groups).view(num_ranks, num_groups)
        out.append(ChunkLayout(send_idx=order + a0, send_counts=gc.sum(1), send_group_counts=gc))
    return out


def receive_positions(C: torch.Tensor, send_key: torch.Tensor, rank: int, experts_per_rank: int):
    """Where each row this rank sends lands in its destination's receive buffers (the `cuda` backend's
    layout, computed on the device from the all-gathered counts; no host synchronisation).

    C: int64[R, R, G], C[s, d, g] = rows source s sends to group g of rank d (every rank holds it);
    send_key: int64[A], destination * G + group of this rank's rows in send order (ascending).
    A destination keeps two buffers: its main experts' groups (g < experts_per_rank) and its replica
    slots' groups; inside each, rows are group-major and, inside a group, ordered by source rank, then
    by the source's send order: the layout a grouped GEMM reads directly.

    Returns (dest int64[A], pos int64[A] row in the destination's buffer, is_slot bool[A])."""
    G = C.shape[2]
    start = receive_starts(C, rank, experts_per_rank)
    mine = C[rank].reshape(-1)
    send_start = torch.cumsum(mine, 0) - mine
    i = torch.arange(send_key.numel(), device=send_key.device)
    pos = start[send_key] + i - send_start[send_key]
    return send_key // G, pos, (send_key % G) >= experts_per_rank


def receive_starts(C: torch.Tensor, rank: int, experts_per_rank: int) -> torch.Tensor:
    """int64[R * G]: where this rank's rows of each (destination, group) key start in the destination's
    receive buffer (main or slot; `receive_positions`' layout)."""
    G = C.shape[2]
    per_group = C.sum(0)  # [d, g]: rows d receives in group g
    start = torch.cumsum(per_group, 1) - per_group  # group-major over all groups
    main_total = per_group[:, :experts_per_rank].sum(1, keepdim=True)
    is_slot_group = torch.arange(G, device=C.device) >= experts_per_rank
    start = torch.where(is_slot_group, start - main_total, start)  # slot groups: own buffer from row 0
    return (start + (torch.cumsum(C, 0)[rank] - C[rank])).reshape(-1)  # rows of lower sources come first


def received_sizes(C: torch.Tensor, rank: int, experts_per_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64[E_loc] rows of each main group, int64[N] rows of each slot group) this rank receives."""
    got = C[:, rank, :].sum(0)
    return got[:experts_per_rank], got[experts_per_rank:]


def own_rows(order: torch.Tensor, dest: torch.Tensor, pos: torch.Tensor, is_slot: torch.Tensor, rank: int,
             region_rows: int) -> torch.Tensor:
    """int64[A] per assignment index (order: each send row's assignment; dest, pos, is_slot: where it goes): its
    row in `rank`'s region when it stays on that rank within the region's region_rows rows (+ region_rows for a
    slot's), else -1. Backend cuda's weighting reads such rows in place (weighting.py's `local`). A scatter whose
    other rows go to a dropped extra element: no host synchronisation."""
    A = order.numel()
    stays = (dest == rank) & (pos < region_rows)
    return torch.full((A + 1,), -1, dtype=torch.int64, device=order.device).scatter_(
        0, torch.where(stays, order, A), torch.where(is_slot, pos + region_rows, pos))[:A]
