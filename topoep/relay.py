"""Relay trees for replica fetches: where each slot fetches its replica from, so that no rank sends every copy.

Without relays every copy of expert e comes from its home rank h = main_rank[e]: a hot expert with a copy on every
rank makes h send R - 1 copies through one NVLink port and one NIC. With relays (`relay_sources`), the copies of e
form one tree per domain, in a fixed order that every rank computes alike from the plan:
  - in h's domain the tree's root is h; elsewhere its root is the domain's first copy, which fetches from h over the
    NIC (the only copy of e that crosses into that domain);
  - the domain's copies, in slot order (rank, then slot), hang below the root as a heap of `fanout` children per
    node: node i of the list [root, copy 1, copy 2, ...] fetches from node (i - 1) // fanout.
A copy can only be sent once it has arrived, so a relayed fetch runs in levels (the copies at depth 1 first, then
depth 2, ...); each level is one transfer, timed at its busiest link (`topoep.links`). The gradient return follows the
trees in reverse, deepest level first, every node summing its children's gradients in list order onto its own before
sending (a fixed order: the sums stay bit-reproducible).

Everything here is tensor code on the plan's device, without host synchronisation: the number of levels is bounded by
the shapes (`max_level`), so a runtime that must not read the plan on the host runs that many levels, empty ones
included. Backend torch (`LayerConfig.relay_fanout`) executes the trees, backend cuda too (both transports), and the
simulator and `topoep.links` model them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from topoep.links import transfer_fs
from topoep.plan import Plan


class RelayTrees(NamedTuple):
    """The relay trees of one plan as a runtime executes them (`relay_trees`)."""

    source: torch.Tensor  # int64[R, N]: the rank each slot fetches its replica from (-1: an empty slot)
    level: torch.Tensor  # int64[R, N]: the level of that transfer (1 = first; 0: an empty slot)
    levels: int  # the levels to run: max_level, a bound from the shapes (the runtime never reads the plan on the host)


def _heap_depth(index: torch.Tensor, fanout: int, max_depth: int) -> torch.Tensor:
    """Depth of node `index` in a heap of `fanout` children per node (root 0 at depth 0), for indices whose depth is
    at most max_depth: the number of depths k >= 1 whose first index, (f^k - 1) / (f - 1) (k for f = 1), it reaches.
    The thresholds are made on the index's device (no host-to-device copy: CUDA-graph capturable)."""
    depths = max_depth
    while fanout > 1 and depths > 1 and fanout ** depths >= 1 << 62:  # beyond any index (and int64)
        depths -= 1
    if depths < 1:
        return torch.zeros_like(index)
    k = torch.arange(1, depths + 1, dtype=index.dtype, device=index.device)
    firsts = k if fanout == 1 else (torch.pow(torch.full_like(k, fanout), k) - 1) // (fanout - 1)
    return (index[..., None] >= firsts).sum(-1).to(index.dtype)


def max_level(topology, fanout: int) -> int:
    """The deepest level any relay tree of `relay_sources` can reach on this topology: a rank holds an expert at most
    once (the plan's invariants), so a tree's list holds at most ranks_per_domain nodes; a remote domain's tree
    starts one level down (its root crossed the NIC)."""
    if isinstance(fanout, bool) or not isinstance(fanout, int) or fanout < 1:
        raise ValueError(f"fanout must be an integer >= 1 (copies one node of a relay tree sends), got {fanout!r}")
    d = topology.ranks_per_domain
    depth = int(_heap_depth(torch.tensor([d - 1]), fanout, d).item())
    return max(1, depth + (topology.num_domains > 1))


def relay_sources(plan: Plan, fanout: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """(source int64[R, N], level int64[R, N]): the rank each slot fetches its replica from and the level of that
    transfer (1: from the home, or the first hop of a tree; -1 and 0 for an empty slot). Deterministic: the same plan
    gives the same trees on every rank and device."""
    if isinstance(fanout, bool) or not isinstance(fanout, int) or fanout < 1:
        raise ValueError(f"fanout must be an integer >= 1 (copies one node of a relay tree sends), got {fanout!r}")
    R, N = plan.num_ranks, plan.num_slots
    se = plan.slot_expert.reshape(-1)
    dev = se.device
    source = torch.full((R * N,), -1, dtype=torch.int64, device=dev)
    level = torch.zeros(R * N, dtype=torch.int64, device=dev)
    if R * N == 0:
        return source.view(R, N), level.view(R, N)
    d = plan.topology.ranks_per_domain
    M = plan.topology.num_domains
    slot_rank = torch.arange(R * N, device=dev) // max(N, 1)
    occ = se >= 0
    home = plan.main_rank.to(dev)[se.clamp(min=0)]
    dom, home_dom = slot_rank // d, home // d
    # copies sorted by (expert, slot index): slot index order is (domain, rank, slot) since domains are contiguous
    big = plan.num_experts * R * N
    key = torch.where(occ, se * (R * N) + torch.arange(R * N, device=dev), torch.full_like(se, big + R * N))
    order = torch.argsort(key)
    group = torch.where(occ, se * M + dom, torch.full_like(se, plan.num_experts * M))[order]  # (expert, domain)
    pos_sorted = torch.arange(R * N, device=dev)
    first = torch.ones(R * N, dtype=torch.bool, device=dev)
    first[1:] = group[1:] != group[:-1]
    start = torch.cummax(torch.where(first, pos_sorted, torch.zeros_like(pos_sorted)), 0).values
    p = pos_sorted - start  # position of the copy within its (expert, domain) group
    o_home, o_dom, o_hdom = home[order], dom[order], home_dom[order]
    local = o_dom == o_hdom
    # list index of the copy in its tree and of its parent: [home, copies...] at home, [copies...] elsewhere
    idx = torch.where(local, p + 1, p)
    parent_idx = torch.div(idx - 1, fanout, rounding_mode="floor")
    # the parent's rank: the home (list index 0 at home), else the copy at that list index of the same group
    parent_pos = torch.where(local, parent_idx - 1, parent_idx)  # its position within the group
    parent_sorted = (start + parent_pos.clamp(min=0)).clamp(max=R * N - 1)
    parent_rank = slot_rank[order][parent_sorted]
    src = torch.where(local & (parent_idx == 0), o_home, parent_rank)
    src = torch.where(~local & (idx == 0), o_home, src)  # a remote domain's root fetches from the home
    max_depth = R * N if fanout == 1 else int(R * N).bit_length() + 1  # a chain, or a heap's depth at most
    lvl = _heap_depth(idx, fanout, max_depth) + (~local).to(torch.int64)
    o_occ = occ[order]
    source[order] = torch.where(o_occ, src, torch.full_like(src, -1))
    level[order] = torch.where(o_occ, lvl, torch.zeros_like(lvl))
    return source.view(R, N), level.view(R, N)


def executed_sources(plan: Plan, fanout: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(source, level) as a runtime executes them: `relay_sources`, unless the net-benefit guard found the direct fetch
    faster for this plan (plan.info["relay"], a bool 0-d tensor, False: `runtime.guard.NetBenefitGuard.relay_fanout`);
    then every copy from its home at level 1, the direct fetch in the trees' form. No host synchronisation."""
    source, level = relay_sources(plan, fanout)
    use = plan.info.get("relay")
    if use is None:
        return source, level
    occ = plan.slot_expert >= 0
    home = plan.main_rank.to(occ.device)[plan.slot_expert.clamp(min=0)]
    return (torch.where(use, source, torch.where(occ, home, -1)),
            torch.where(use, level, occ.to(torch.int64)))


def relay_trees(plan: Plan, fanout: int) -> RelayTrees:
    """`executed_sources` with the number of levels a runtime runs (`max_level`): device tensors, no host sync."""
    return RelayTrees(*executed_sources(plan, fanout), max_level(plan.topology, fanout))


def relay_levels(plan: Plan, source: torch.Tensor, level: torch.Tensor, levels: int | None = None) -> torch.Tensor:
    """int64[L, R, R]: the replica transfers of each level (copies src -> dst); L = `levels` (e.g. `max_level`, no
    host sync), or by default the largest level (at least 1; the host reads one number). Level l's transfers can start
    once level l - 1's are done."""
    R, N = plan.num_ranks, plan.num_slots
    dev = source.device
    occ = (source.reshape(-1) >= 0).to(torch.int64)
    lv = level.reshape(-1)
    L = levels if levels is not None else max(1, int(lv.max()) if lv.numel() else 1)
    dst = torch.arange(R * N, device=dev) // max(N, 1)
    # an empty slot adds 0 at index 0 (no boolean indexing: the shapes stay fixed)
    at = torch.where(occ > 0, (lv - 1).clamp(min=0) * R * R + source.reshape(-1).clamp(min=0) * R + dst, 0)
    flat = torch.zeros(L * R * R, dtype=torch.int64, device=dev)
    flat.index_add_(0, at, occ)
    return flat.view(L, R, R)


def relay_fetch_fs(plan: Plan, fanout: int, topology) -> tuple[torch.Tensor, torch.Tensor]:
    """(femtoseconds int64 0-d, levels int64 0-d) of one relayed replica fetch of `plan` under `topology`'s integer
    per-byte costs: each level at its busiest link (`topoep.links.transfer_fs`), the levels one after the other, and
    the number of levels that carry a copy. Exact integers (the net-benefit guard decides on them); no host
    synchronisation (`max_level` levels)."""
    flows = relay_levels(plan, *relay_sources(plan, fanout), max_level(plan.topology, fanout))
    return transfer_fs(flows, plan.expert_bytes, topology).sum(), (flows.sum((1, 2)) > 0).sum()


def sender_copies(plan: Plan, source: torch.Tensor | None = None) -> dict[str, int]:
    """How many replica copies the busiest senders send in one fetch of `plan`: with `source` (int64[R, N], e.g.
    `executed_sources`' first tensor) as the slots fetch, else every copy from its home. "nvlink" and "nic": the most
    copies one rank sends over its NVLink port and over its NIC, all experts together; "nvlink_expert" and
    "nic_expert": the most copies of one expert one rank sends over each. With relay trees of `fanout` children a
    rank sends at most `fanout` copies of an expert over NVLink and its home at most one per other domain over the
    NIC. Reads the counts on the host (a report, not the runtime)."""
    R, E = plan.num_ranks, plan.num_experts
    se = plan.slot_expert
    occ = se >= 0
    if source is None:
        source = torch.where(occ, plan.main_rank.to(se.device)[se.clamp(min=0)], -1)
    dom = plan.topology.domain_of.to(se.device)
    dst = torch.arange(R, device=se.device)[:, None].expand_as(se)
    src = source.clamp(min=0)
    nic = occ & (dom[src] != dom[dst])
    out = {}
    for name, mask in (("nvlink", occ & ~nic), ("nic", nic)):
        one = torch.ones_like(src[mask])
        per_rank = torch.zeros(R, dtype=torch.int64, device=se.device).index_add_(0, src[mask], one)
        per_expert = torch.zeros(R * E, dtype=torch.int64, device=se.device).index_add_(0, src[mask] * E + se[mask],
                                                                                         one)
        out[name], out[f"{name}_expert"] = int(per_rank.max()), int(per_expert.max())
    return out
