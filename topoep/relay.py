"""Relay trees for replica fetches: where each slot fetches its replica from, so that no rank sends every copy.

Without relays every copy of expert e comes from its home rank h = main_rank[e]: a hot expert with a copy on every
rank makes h send R - 1 copies through one NVLink port and one NIC. With relays (`relay_sources`), the copies of e
form one tree per domain, and the domains' roots one tree across the NIC, in a fixed order that every rank computes
alike from the plan:
  - in h's domain the tree's root is h; elsewhere its root is the domain's first copy (the only copy of e that
    crosses into that domain, over the NIC);
  - the domain's copies hang below the root as a heap of `fanout` children per node: node i of the list [root,
    copy 1, copy 2, ...] fetches from node (i - 1) // fanout. The list is in order of the copies' ranks' duty (how
    many replicated experts the rank is home to, `relay_duty`), then in slot order (rank, then slot): the first nodes
    relay, so relays are drawn first from the ranks with the fewest trees of their own to feed;
  - the remote domains' roots hang below h the same way (the NIC tree): node i of the list [h, root of domain
    dom(h) + 1, root of dom(h) + 2, ...] (the domains that hold a copy of e, in cyclic order from h's) fetches from
    node (i - 1) // fanout, so h sends at most `fanout` copies of e over its NIC, not one per domain, and a root
    relays to at most `fanout` other domains beside its own domain's children (`max_children`).
A copy can only be sent once it has arrived, so a relayed fetch runs in levels (the copies at depth 1 first, then
depth 2, ...). With `chunks` C > 1 every copy travels in C chunks (contiguous element ranges of the weights), and a
node forwards a chunk as soon as it has it: the fetch is a pipeline of L + C - 1 steps (`relay_steps`), step s moving
chunk s - (l - 1) of every level l with 0 <= s - (l - 1) < C, so the levels overlap instead of waiting for each other.
Each step is one transfer of 1/C of the copies, timed at its busiest link (`topoep.links`); levels that share a step
share its links. The gradient return follows the trees in reverse, deepest level first (chunked alike), every node
summing its children's gradients in list order onto its own before sending (a fixed order, element by element: the
sums stay bit-reproducible and do not depend on C).

A fetch can also run copy by copy (`RELAY_SCHEDULES` "async"): each copy leaves as soon as its source holds it, so
a deep tree's second hop runs beside the first level's other copies instead of after all of them; it takes the longer
of its busiest link over the whole fetch and its longest chain of hops (`async_fetch_fs`, optimistic: contention
along a chain is not in it). The copies and the gradient sums are the same as level by level.

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


RELAY_SCHEDULES = ("levels", "async")
"""How a relayed fetch runs: "levels", one level after the other (each copy sent on once the whole level arrived;
`relay_steps`, `relay_fetch_fs`), or "async", copy by copy (a copy leaves as soon as its source holds it:
`copy_arrival`, `async_fetch_fs`)."""


class RelayTrees(NamedTuple):
    """The relay trees of one plan as a runtime executes them (`relay_trees`)."""

    source: torch.Tensor  # int64[R, N]: the rank each slot fetches its replica from (-1: an empty slot)
    level: torch.Tensor  # int64[R, N]: the level of that transfer (1 = first; 0: an empty slot)
    levels: int  # the levels to run: max_level, a bound from the shapes (the runtime never reads the plan on the host)
    chunks: int = 1  # chunks per copy (`relay_steps`): the runtime runs levels + chunks - 1 steps
    schedule: str = "levels"  # RELAY_SCHEDULES: level by level, or copy by copy ("async")
    fanout: int = 0  # children per node (the copy-by-copy return's table of children; 0: not given)


def max_children(fanout: int) -> int:
    """The most copies of one expert that a node of the trees of `relay_sources` sends: `fanout` into its domain over
    NVLink and, a home or a remote domain's root, `fanout` roots of other domains over its NIC."""
    return 2 * fanout


def check_chunks(chunks, what: str = "chunks") -> int:
    """`chunks` if it is an integer >= 1, else a ValueError naming `what`."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"{what} must be an integer >= 1 (the chunks a relayed replica copy travels in, forwarded "
                         f"down the tree as each arrives), got {chunks!r}")
    return chunks


def chunk_range(numel: int, chunks: int, c: int) -> tuple[int, int]:
    """Elements [lo, hi) of chunk c of a copy of numel elements in `chunks` chunks: chunks of ceil(numel / chunks)
    elements, the last one shorter (empty ones possible when numel < chunks)."""
    span = -(-numel // chunks)
    return min(numel, c * span), min(numel, (c + 1) * span)


def step_chunk(step: int, level: int, chunks: int) -> int | None:
    """The chunk that the copies of `level` (1-based) move in fetch step `step` (0-based) of a pipeline of `chunks`
    chunks, or None when that level is idle in that step. The gradient return runs the same steps with the levels
    reversed (level l of L moves like level L + 1 - l)."""
    c = step - (level - 1)
    return c if 0 <= c < chunks else None


def check_schedule(schedule, chunks: int, what: str = "schedule") -> str:
    """`schedule` if it is one of RELAY_SCHEDULES and, copy by copy, its copies travel whole (chunks 1); else a
    ValueError naming `what`."""
    if schedule not in RELAY_SCHEDULES:
        raise ValueError(f"{what} must be one of {', '.join(RELAY_SCHEDULES)}, got {schedule!r}")
    if schedule == "async" and chunks != 1:
        raise ValueError(f"{what}='async' moves whole copies, each as soon as its source holds it: relay_chunks must "
                         f"be 1, got {chunks}")
    return schedule


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
    once beside its own main experts (the plan's invariants), and a copy on the expert's home rank is no node of a
    tree, so a tree's list holds at most ranks_per_domain nodes; a remote domain's tree starts as deep as its root sits
    in the NIC tree (at most num_domains nodes)."""
    if isinstance(fanout, bool) or not isinstance(fanout, int) or fanout < 1:
        raise ValueError(f"fanout must be an integer >= 1 (copies one node of a relay tree sends), got {fanout!r}")
    d, M = topology.ranks_per_domain, topology.num_domains
    depth = int(_heap_depth(torch.tensor([d - 1]), fanout, d).item())
    nic = int(_heap_depth(torch.tensor([M - 1]), fanout, M).item())  # the deepest root of the NIC tree
    return max(1, depth + nic)


def relay_duty(plan: Plan) -> torch.Tensor:
    """int64[R]: how many of each rank's experts have a copy in some slot: the trees it roots as a home, each sending
    up to `fanout` copies into its domain and one into every other domain that holds one. The trees take their relays
    from the ranks with the least of it (`relay_sources`). No host synchronisation."""
    se = plan.slot_expert.reshape(-1)
    E = plan.num_experts
    held = torch.zeros(E, dtype=torch.int64, device=se.device).index_add_(0, se.clamp(min=0), (se >= 0).to(torch.int64))
    return torch.zeros(plan.num_ranks, dtype=torch.int64, device=se.device).index_add_(
        0, plan.main_rank.to(se.device), (held > 0).to(torch.int64))


def relay_sources(plan: Plan, fanout: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """(source int64[R, N], level int64[R, N]): the rank each slot fetches its replica from and the level of that
    transfer (1: from the home; deeper: down a tree, the NIC tree's levels first; -1 and 0 for an empty slot).
    Deterministic: the same plan gives the same trees on every rank and device (csrc/relay_tree.cuh runs the same
    rule per copy)."""
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
    E = plan.num_experts
    slot_rank = torch.arange(R * N, device=dev) // max(N, 1)
    home = plan.main_rank.to(dev)[se.clamp(min=0)]
    # a copy on its expert's own home rank (the capacity step may place one) is copied within that rank at level 1
    # and is no node of a tree: a tree's list then holds at most ranks_per_domain nodes (`max_level`)
    own = (se >= 0) & (slot_rank == home)
    occ = (se >= 0) & ~own
    dom, home_dom = slot_rank // d, home // d
    rel = (dom - home_dom) % M  # domains in cyclic order from the home's (0: the home's own)
    # copies sorted by (expert, domain in that order, duty of their rank, slot index), duty = how many replicated
    # experts the rank is home to (`relay_duty`): the ranks with the least of it come first and relay
    duty = relay_duty(plan)
    key = ((se.clamp(min=0) * M + rel) * (E + 1) + duty[slot_rank]) * (R * N) + torch.arange(R * N, device=dev)
    key = torch.where(occ, key, torch.full_like(se, E * M * (E + 1) * R * N))
    order = torch.argsort(key)
    o_occ = occ[order]
    o_e = torch.where(o_occ, se[order], E)  # (the unoccupied sort last, as expert E)
    group = o_e * M + rel[order]  # (expert, domain)
    pos_sorted = torch.arange(R * N, device=dev)
    first = torch.ones(R * N, dtype=torch.bool, device=dev)
    first[1:] = group[1:] != group[:-1]
    start = torch.cummax(torch.where(first, pos_sorted, torch.zeros_like(pos_sorted)), 0).values
    p = pos_sorted - start  # position of the copy within its (expert, domain) group
    o_home = home[order]
    local = rel[order] == 0
    # list index of the copy in its domain's tree and of its parent: [home, copies...] at home, [copies...] elsewhere
    idx = torch.where(local, p + 1, p)
    parent_idx = torch.div(idx - 1, fanout, rounding_mode="floor")
    # the parent's rank: the home (list index 0 at home), else the copy at that list index of the same group
    parent_pos = torch.where(local, parent_idx - 1, parent_idx)  # its position within the group
    parent_sorted = (start + parent_pos.clamp(min=0)).clamp(max=R * N - 1)
    o_rank = slot_rank[order]
    parent_rank = o_rank[parent_sorted]
    src = torch.where(local & (parent_idx == 0), o_home, parent_rank)
    # the remote domains' roots form the NIC tree of the expert: [home, roots in domain order from the home's...], a
    # heap of `fanout` children per node; nic: a remote copy's domain's index in that list (its root's)
    root = first & ~local & o_occ
    expert_first = torch.ones(R * N, dtype=torch.bool, device=dev)
    expert_first[1:] = o_e[1:] != o_e[:-1]
    roots_so_far = torch.cumsum(root.to(torch.int64), 0)
    e_start = torch.cummax(torch.where(expert_first, pos_sorted, torch.zeros_like(pos_sorted)), 0).values
    nic = torch.where(local, torch.zeros_like(p), roots_so_far - roots_so_far[e_start] + root[e_start].to(torch.int64))
    root_rank = torch.full((E * M + 1,), -1, dtype=torch.int64, device=dev)  # (expert, NIC index) -> the root's rank
    root_rank.index_copy_(0, torch.where(root, o_e * M + nic, E * M), o_rank)
    nic_parent = torch.div(nic - 1, fanout, rounding_mode="floor")
    nic_src = torch.where(nic_parent == 0, o_home, root_rank[(o_e.clamp(max=E - 1) * M + nic_parent.clamp(min=0))])
    src = torch.where(~local & (idx == 0), nic_src, src)  # a remote domain's root: from its parent in the NIC tree
    max_depth = R * N if fanout == 1 else int(R * N).bit_length() + 1  # a chain, or a heap's depth at most
    lvl = _heap_depth(idx, fanout, max_depth) + torch.where(local, torch.zeros_like(nic),
                                                            _heap_depth(nic, fanout, max_depth))
    source[order] = torch.where(o_occ, src, torch.full_like(src, -1))
    level[order] = torch.where(o_occ, lvl, torch.zeros_like(lvl))
    source = torch.where(own, home, source)
    level = torch.where(own, torch.ones_like(level), level)
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


def relay_trees(plan: Plan, fanout: int, chunks: int = 1, schedule: str = "levels") -> RelayTrees:
    """`executed_sources` with the number of levels a runtime runs (`max_level`), the chunks per copy and the
    schedule: device tensors, no host sync."""
    return RelayTrees(*executed_sources(plan, fanout), max_level(plan.topology, fanout), check_chunks(chunks),
                      check_schedule(schedule, chunks), fanout)


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


def relay_steps(flows: torch.Tensor, chunks: int = 1) -> torch.Tensor:
    """[L + C - 1, R, R]: the copies of each step of a fetch whose levels' copies are `flows` [L, R, R]
    (`relay_levels`) and travel in C = `chunks` chunks: step s carries chunk s - (l - 1) of level l (1-based) for
    0 <= s - (l - 1) < C (`step_chunk`), so it holds the copies of the levels l - 1 in [s - C + 1, s], each moving
    1/C of its bytes. C = 1: the levels themselves."""
    check_chunks(chunks)
    L = flows.shape[0]
    steps = flows.new_zeros((L + chunks - 1, *flows.shape[1:]))
    for c in range(chunks):
        steps[c:c + L] += flows
    return steps


def relay_fetch_fs(plan: Plan, fanout: int, topology, chunks: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(femtoseconds int64 0-d, steps int64 0-d) of one relayed replica fetch of `plan` under `topology`'s integer
    per-byte costs: each step of `relay_steps` at its busiest link (`topoep.links.transfer_fs` of all the copies the
    step carries), the steps one after the other, each moving 1/chunks of its copies' bytes (the sum of the steps'
    femtoseconds, divided by chunks, rounded down); and the number of steps that carry a copy (each pays a
    transfer's latency). Exact integers (the net-benefit guard decides on them); no host synchronisation
    (`max_level` levels)."""
    flows = relay_levels(plan, *relay_sources(plan, fanout), max_level(plan.topology, fanout))
    steps = relay_steps(flows, chunks)
    return transfer_fs(steps, plan.expert_bytes, topology).sum() // chunks, (steps.sum((1, 2)) > 0).sum()


def copy_arrival(plan: Plan, source: torch.Tensor, level: torch.Tensor, hop: torch.Tensor,
                 levels: int | None = None) -> torch.Tensor:
    """[R, N] (hop's dtype): when each slot holds its copy in a fetch that runs copy by copy (`RELAY_SCHEDULES`
    "async"): a copy leaves its source as soon as the source holds it (a home holds its experts from the start, 0) and
    takes hop[source, dst] (e.g. expert_bytes x the link's per-byte cost: `Topology.cost_fs`, or seconds), so a slot's
    arrival is the sum of the hops on its path from the home. Link contention is not in it (`async_fetch_fs` adds the
    busiest link). 0 for an empty slot. Walks `levels` levels with fixed shapes (e.g. `max_level`: no host
    synchronisation; default the largest level, which the host reads)."""
    R, N, E = plan.num_ranks, plan.num_slots, plan.num_experts
    se = plan.slot_expert.reshape(-1)
    dev = se.device
    src, lv = source.reshape(-1), level.reshape(-1)
    occ = se >= 0
    L = levels if levels is not None else max(1, int(lv.max()) if lv.numel() else 1)
    dst = torch.arange(R * N, device=dev) // max(N, 1)
    e = se.clamp(min=0)
    hop = hop.to(dev)
    cost = torch.where(occ & (src != dst), hop[src.clamp(min=0), dst], torch.zeros((), dtype=hop.dtype, device=dev))
    ready = torch.zeros(R * E + 1, dtype=hop.dtype, device=dev)  # (rank, expert) -> when it holds it; R E: unused
    at = dst * E + e
    for l in range(1, L + 1):  # parents first: a level's sources got their copies in the levels before
        take = occ & (lv == l)
        ready.index_copy_(0, torch.where(take, at, R * E), ready[src.clamp(min=0) * E + e] + cost)
    return torch.where(occ, ready[at], torch.zeros((), dtype=hop.dtype, device=dev)).view(R, N)


def async_fetch_fs(plan: Plan, fanout: int, topology) -> tuple[torch.Tensor, torch.Tensor]:
    """(femtoseconds int64 0-d, steps int64 0-d) of one relayed replica fetch of `plan` run copy by copy
    (`RELAY_SCHEDULES` "async"), under `topology`'s integer per-byte costs: the longer of its busiest link over the
    whole fetch (every level's copies together, `topoep.links.transfer_fs`) and its longest chain of hops
    (`copy_arrival` with hop = expert_bytes x cost_fs), an optimistic estimate (a hop that finds its link busy waits
    in a real schedule); and the levels that carry a copy (the longest chain's hops at most: each pays a transfer's
    latency, as in `relay_fetch_fs`). Exact integers; no host synchronisation (`max_level` levels)."""
    source, level = relay_sources(plan, fanout)
    L = max_level(plan.topology, fanout)
    flows = relay_levels(plan, source, level, L)
    topo = topology.on(flows.device)
    busiest = transfer_fs(flows.sum(0), plan.expert_bytes, topo)
    chain = copy_arrival(plan, source, level, topo.cost_fs * int(plan.expert_bytes), L).amax()
    return torch.maximum(busiest, chain), (flows.sum((1, 2)) > 0).sum()


def direct_beyond_tree(plan: Plan, fanout: int) -> torch.Tensor:
    """bool 0-d: whether the direct fetch of `plan` (every copy from its home) makes a home send more copies of one
    expert than the relay trees of `fanout` children let any rank send: more than `fanout` into the home's own domain
    (over NVLink), or more than `fanout` into the other domains together (over the NIC). The net-benefit guard then
    relays that plan's fetch even where the direct one is predicted faster, so no sender carries more than a tree's
    share. No host synchronisation."""
    se = plan.slot_expert
    occ = se >= 0
    dom = plan.topology.domain_of.to(se.device)
    D, E, R = plan.topology.num_domains, plan.num_experts, plan.num_ranks
    dst = torch.arange(R, device=se.device)[:, None].expand_as(se)
    key = (se.clamp(min=0) * D + dom[dst]).reshape(-1)
    sent = occ & (plan.main_rank.to(se.device)[se.clamp(min=0)] != dst)  # a copy on the home rank crosses no link
    counts = torch.zeros(E * D, dtype=torch.int64, device=se.device).index_add_(
        0, key, sent.reshape(-1).to(torch.int64)).view(E, D)  # copies of e the home sends into domain m
    home_dom = dom[plan.main_rank.to(se.device)][:, None]
    same = counts.gather(1, home_dom)
    other = counts.scatter(1, home_dom, 0)
    return (same > fanout).any() | (other.sum(1) > fanout).any()


def sender_copies(plan: Plan, source: torch.Tensor | None = None) -> dict[str, int]:
    """How many replica copies the busiest senders send in one fetch of `plan`: with `source` (int64[R, N], e.g.
    `executed_sources`' first tensor) as the slots fetch, else every copy from its home. "nvlink" and "nic": the most
    copies one rank sends over its NVLink port and over its NIC, all experts together; "nvlink_expert" and
    "nic_expert": the most copies of one expert one rank sends over each. With relay trees of `fanout` children a
    rank sends at most `fanout` copies of an expert over NVLink and at most `fanout` over its NIC. Reads the counts
    on the host (a report, not the runtime)."""
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
    for name, mask in (("nvlink", occ & ~nic & (src != dst)), ("nic", nic)):  # a copy within a rank crosses no link
        one = torch.ones_like(src[mask])
        per_rank = torch.zeros(R, dtype=torch.int64, device=se.device).index_add_(0, src[mask], one)
        per_expert = torch.zeros(R * E, dtype=torch.int64, device=se.device).index_add_(0, src[mask] * E + se[mask],
                                                                                         one)
        out[name], out[f"{name}_expert"] = int(per_rank.max()), int(per_expert.max())
    return out
