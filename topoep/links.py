"""Per-link cost model of a plan: bytes on every rank's NVLink port and NIC, each direction, per transfer phase, and the
time of the busiest link.

The paper's eq. 6-7 (`topoep.metrics`: t_token, t_replica) sum bytes x per-byte cost over all transfers. A transfer
phase ends when its busiest link is done: one rank's NIC, one rank's NVLink port, or, for replicas, the rank that
sends every copy of a hot expert. Here every phase of one layer call is a matrix of flows F[s, r] (bytes from rank s
to rank r); a flow between two ranks of one domain crosses the sender's NVLink port out and the receiver's in, a flow
between domains the sender's NIC out and the receiver's NIC in. A link's time is the sum of its flows' bytes times
their per-byte cost (the topology's cost matrix: intra_cost on NVLink, inter_cost on the NICs of a two-level
topology), and a phase takes its busiest link's time; NVLink and the NICs run at the same time.

Phases of one call: dispatch (token rows s -> the rank of each instance, `token_matrix`), combine (its transpose),
replica fetch (one expert's weights from its main rank to each replica's rank, `replica_matrix`; the backward reload
is the same transfer again) and gradient return (the fetch's transpose). The simulator (`topoep_research.sim`) and
`topoep.metrics` read these functions; nothing here synchronises the host.

How the token transfers and the expert compute of one call add up when they run as paper 3.3's two-stream chunk
pipeline (`chunk_pipeline`, `pipelined_layer_s`) is here too: the simulator times its pipelined execution with it and
the net-benefit guard, with `token_chunks`, predicts with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from topoep.plan import Plan

PHASES = ("dispatch", "combine", "replica_fetch", "grad_return")


def _later(a, b):
    """max(a, b) of floats or float64 tensors (elementwise)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.maximum(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64))
    return max(a, b)


def chunk_pipeline(dispatch, compute, combine, *, compute_ready=0.0, tail_compute=0.0):
    """(comm stream end, compute stream end) of the two-stream chunk schedule of paper 3.3: the comm stream runs every
    dispatch, then combine i once compute i is done; compute i starts when dispatch i and compute i-1 are done (and not
    before compute_ready); tail_compute runs after the last chunk (the weight gradients in backward). Every time is a
    float or a float64 tensor (elementwise: one schedule per element), added in this fixed order (the guard's CUDA
    kernel repeats it operation for operation)."""
    t, d_end = 0.0, []
    for d in dispatch:
        t = t + d
        d_end.append(t)
    comp, x_end = compute_ready, []
    for de, x in zip(d_end, compute):
        comp = _later(comp, de) + x
        x_end.append(comp)
    for xe, c in zip(x_end, combine):
        t = _later(t, xe) + c
    return t, comp + tail_compute


def _div(a, b):
    """a / b, correctly rounded for floats and float64 tensors alike: a tensor is divided by a tensor on its device
    (torch divides a CUDA tensor by a Python number as a product with its reciprocal, and a Python number by a tensor
    as the tensor's reciprocal times the number, either of which can differ in the last bit from the division the CPU
    and the guard's CUDA kernel make)."""
    if isinstance(b, torch.Tensor):
        return torch.as_tensor(a, dtype=torch.float64, device=b.device) / b
    if isinstance(a, torch.Tensor):
        return a / a.new_full((), float(b))
    return a / b


def pipelined_layer_s(x, t, chunks: int):
    """Expert compute and token transfers of one layer call (forward + backward) as `chunk_pipeline` runs them: each
    pass dispatches and combines `chunks` chunks of t / chunks (t: one dispatch's time, the combine mirrors it); the
    forward computes x / 3 over the chunks, the backward the data gradients (x / 3) over the chunks and the weight
    gradients (x / 3) after the last (x: the straggler's expert time, forward + backward). Floats or float64 tensors;
    each division correctly rounded (`_div`)."""
    third = _div(x, 3)
    d, c = _div(t, chunks), _div(third, chunks)
    fwd = chunk_pipeline([d] * chunks, [c] * chunks, [d] * chunks)
    bwd = chunk_pipeline([d] * chunks, [c] * chunks, [d] * chunks, tail_compute=third)
    return _later(*fwd) + _later(*bwd)


def overlapped_forward_s(main, slot, t_ffn: float, t_chunk, delay, t_rep, chunks: int, compute_overhead: float = 0.0):
    """The forward of `chunk_pipeline` (dispatch, compute, combine of `chunks` chunks of t_chunk each) with the replica
    fetch running beside it (backend cuda's LayerConfig.fetch_overlap, the simulator's Execution.fetch_overlap): its
    end, seconds from the fetch's start.

    The fetch goes first on every link it shares with the dispatches, so it ends at t_rep, and the dispatches end
    `delay` later than alone (what the busiest shared link carries beyond the dispatches' own busiest link; below 0
    counts as 0), stretched evenly. Per rank (main, slot: float64[R], its assignments on main experts and on slots):
    chunk i's main rows (1/chunks of the rank's main load at t_ffn each; the forward is a third of forward + backward)
    start once dispatch i and the rank's previous chunk are done; its slot rows then wait for the fetch. A combine
    waits for every rank's chunk. t_chunk, delay and t_rep are floats or float64 0-d tensors (then the result is one,
    and nothing is read on the host). The simulator (`topoep_research.sim`) and the net-benefit guard
    (`NetBenefitGuard.fetch_overlap`) both time it here; the operations run in this fixed order, each division
    correctly rounded (`_div`), so the guard's CUDA kernel can repeat them."""
    n = chunks
    span = n * t_chunk
    if isinstance(span, torch.Tensor):  # (no host read: a plan without token transfers is not stretched)
        stretch = torch.where(span > 0, 1.0 + _div(_later(delay, 0.0), span), torch.ones_like(span))
    else:
        stretch = 1.0 + _div(_later(delay, 0.0), span) if span > 0 else 1.0
    comp = torch.zeros_like(main, dtype=torch.float64)
    t = span * stretch
    main_part = _div(_div(t_ffn * main, 3), n)
    slot_part = _div(_div(t_ffn * slot, 3), n)
    overhead = compute_overhead / 3 / n
    for i in range(n):
        comp = _later(comp, (i + 1) * t_chunk * stretch) + overhead + main_part
        comp = _later(comp, t_rep) + slot_part
        t = _later(t, comp.max()) + t_chunk
    return t


@dataclass(frozen=True)
class LinkLoads:
    """Bytes of one transfer phase on every rank's links, float64[R] each."""

    nvl_out: torch.Tensor
    nvl_in: torch.Tensor
    nic_out: torch.Tensor
    nic_in: torch.Tensor

    def busiest(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(bytes on the busiest NVLink port, bytes on the busiest NIC), 0-d float64 tensors (either direction)."""
        return torch.maximum(self.nvl_out, self.nvl_in).max(), torch.maximum(self.nic_out, self.nic_in).max()

    def as_dict(self) -> dict[str, torch.Tensor]:
        return {"nvl_out": self.nvl_out, "nvl_in": self.nvl_in, "nic_out": self.nic_out, "nic_in": self.nic_in}


def token_matrix(plan: Plan) -> torch.Tensor:
    """int64[R, R]: A[s, r] = assignments of source s executed on rank r (one dispatch's rows s -> r)."""
    R = plan.num_ranks
    return torch.zeros(R, R, dtype=torch.int64, device=plan.route.device).index_add_(1, plan.instance_rank, plan.route)


def replica_matrix(plan: Plan) -> torch.Tensor:
    """int64[R, R]: B[m, r] = replicas on rank r whose main instance is on rank m (one fetch's W-sized transfers
    m -> r; the gradient return is its transpose)."""
    R, N = plan.num_ranks, plan.num_slots
    se = plan.slot_expert.reshape(-1)
    occ = se >= 0  # an empty slot adds 0 (no boolean indexing: that would synchronise the host)
    dst = torch.arange(R, device=se.device).repeat_interleave(N)
    src = plan.main_rank.to(se.device)[se.clamp(min=0)]
    return torch.zeros(R * R, dtype=torch.int64, device=se.device).index_add_(
        0, src * R + dst, occ.to(torch.int64)).view(R, R)


def _link_sums(f: torch.Tensor, domain_of: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(NVLink out, NVLink in, NIC out, NIC in) sums of flows f [..., R, R] whose diagonal is zero, in f's dtype."""
    domain_of = domain_of.to(f.device)
    same = domain_of[:, None] == domain_of[None, :]
    intra, inter = f * same, f * ~same
    return intra.sum(-1), intra.sum(-2), inter.sum(-1), inter.sum(-2)


def link_loads(flows: torch.Tensor, domain_of: torch.Tensor) -> LinkLoads:
    """The link loads of one transfer with flows [R, R] (bytes s -> r; the diagonal stays on its rank); flows
    [..., R, R] give loads [..., R] (several transfers at once)."""
    f = flows.double() * (1 - torch.eye(flows.shape[-1], dtype=torch.float64, device=flows.device))
    return LinkLoads(*_link_sums(f, domain_of))


def token_loads(plan: Plan, top_k: int | None = None, token_bytes: float | None = None) -> LinkLoads:
    """Bytes of one dispatch on every link (the combine mirrors it) at `token_bytes` per row (default the plan's).

    top_k None: one row per assignment, rank to rank (`token_matrix`; an all-to-all of permuted rows). An integer:
    DeepEP-style deduplication, estimated from the route: a token crosses to rank r once whatever number of its
    assignments r executes. A token of s selects instance p with probability route[s, p] / T_s (T_s = omega[s].sum()
    / top_k tokens; a token selects an expert at most once, each assignment runs on one instance), so it selects
    expert e on rank r with the sum of those of e's instances on r (they exclude each other: a main and a copy on its
    home rank); taking experts as independent, T_s (1 - prod_e (1 - q[s, e, r])) tokens go to rank r. Across domains
    a token crosses the NIC once per destination domain (the same product with q summed over e's instances in the
    domain: a main and its copies there, or several copies), into the GPU of s's local index there, which forwards it
    over NVLink to every other destination rank of that domain. Domains are contiguous blocks of ranks
    (`Topology`)."""
    S = float(plan.token_bytes if token_bytes is None else token_bytes)
    dom = plan.topology.domain_of.to(plan.route.device)
    if top_k is None:
        return link_loads(token_matrix(plan).double() * S, dom)
    R, M, d = plan.num_ranks, plan.topology.num_domains, plan.topology.ranks_per_domain
    T = (plan.omega.sum(1).double() / top_k).clamp(min=1e-9)
    q = plan.route.double() / T[:, None]  # [R, P] P(a token of s selects instance p)
    inst_r, P, dev = plan.instance_rank, q.shape[1], q.device
    inst_e = plan.instance_expert.clamp(min=0)  # an empty slot (-1) routes nothing: any group
    # per (expert, rank): a copy on its expert's home rank joins the main instance (index e, on that rank)
    group = torch.where(plan.main_rank.to(dev)[inst_e] == inst_r, inst_e, torch.arange(P, device=dev))
    q_rank = torch.zeros(R, P, dtype=torch.float64, device=dev).index_add_(1, group, q)
    miss = torch.log1p(-q_rank.clamp(max=1 - 1e-12))  # [R, groups] log P(a token skips e on r); 0 for no group
    miss_rank = torch.zeros(R, R, dtype=torch.float64, device=dev).index_add_(1, inst_r, miss)
    rows = T[:, None] * -torch.expm1(miss_rank)  # distinct tokens s -> r
    rows = rows * (1 - torch.eye(R, dtype=torch.float64, device=dev))
    # per (expert, domain): e's instances in domain m together
    E = plan.num_experts
    q_dom = torch.zeros(R, E * M, dtype=torch.float64, device=dev).index_add_(1, inst_e * M + dom[inst_r], q)
    miss_dom = torch.log1p(-q_dom.clamp(max=1 - 1e-12)).view(R, E, M).sum(1)  # [R, M]
    rows_dom = T[:, None] * -torch.expm1(miss_dom)  # [R, M]
    rows_dom = rows_dom * (torch.arange(M, device=miss.device)[None, :] != dom[:, None])
    same = dom[:, None] == dom[None, :]
    local = torch.arange(R, device=miss.device) % d
    intra = rows * same
    # s's tokens for domain m arrive at the GPU of s's local index there, m * d + local(s): summed over the sources
    # of each local index (reshapes and sums, no atomics: the same bits on every rank and run)
    nic_in = rows_dom.view(M, d, M).sum(0).t().reshape(R)
    fwd = rows * ~same * (local[:, None] != local[None, :])  # tokens s -> r that the peer forwards over NVLink
    # the peer of (s, dom(r)) is dom(r) * d + local(s): it sends what it forwards
    nvl_out = intra.sum(1) + fwd.view(M, d, M, d).sum((0, 3)).t().reshape(R)
    nvl_in = intra.sum(0) + fwd.sum(0)
    return LinkLoads(nvl_out * S, nvl_in * S, rows_dom.sum(1) * S, nic_in * S)


def loads_seconds(loads: LinkLoads, topology) -> torch.Tensor:
    """Seconds of one transfer with these link loads (bytes): its busiest link's, NVLink at the topology's
    intra_cost and NICs at its inter_cost per byte (0-d float64)."""
    nvl, nic = loads.busiest()
    return torch.maximum(nvl * float(topology.intra_cost), nic * float(topology.inter_cost))


def phase_flows(plan: Plan) -> dict[str, torch.Tensor]:
    """{phase: float64[R, R] bytes s -> r} of one layer call's transfers (PHASES), at the plan's token_bytes and
    expert_bytes."""
    dispatch = token_matrix(plan).double() * float(plan.token_bytes)
    fetch = replica_matrix(plan).double() * float(plan.expert_bytes)
    return {"dispatch": dispatch, "combine": dispatch.t(), "replica_fetch": fetch, "grad_return": fetch.t()}


def phase_loads(plan: Plan) -> dict[str, LinkLoads]:
    """{phase: LinkLoads in bytes} of one layer call's transfers."""
    dom = plan.topology.domain_of
    return {k: link_loads(f, dom) for k, f in phase_flows(plan).items()}


def transfer_seconds(flows: torch.Tensor, topology) -> torch.Tensor:
    """Seconds of one transfer with flows [R, R] (bytes): its busiest link's time, each flow's bytes at its per-byte
    cost (0-d float64, on the flows' device); flows [..., R, R]: one time per transfer, [...]."""
    topo = topology.on(flows.device)
    seconds = link_loads(flows.double() * topo.cost, topo.domain_of)
    return torch.stack([t.amax(-1) for t in seconds.as_dict().values()]).amax(0)


def transfer_fs(counts: torch.Tensor, unit_bytes: int, topology) -> torch.Tensor:
    """`transfer_seconds` in exact integers: femtoseconds of one transfer that moves counts[s, r] units of unit_bytes
    bytes from s to r, at its busiest link, every flow at the topology's integer per-byte cost (`Topology.cost_fs`):
    int64 0-d, or [...] for counts [..., R, R]. Integer sums do not depend on their order, so any device and any
    kernel (`topoep.runtime.guard_cuda`) gets the same value; the net-benefit guard decides on these. Exact while a
    link's femtoseconds stay below 2^63 (e.g. 10^6 rows of 8 KiB at 50 GB/s: 1.6e17)."""
    return link_fs(counts, unit_bytes, topology).amax(-1).amax(0)


def link_fs(counts: torch.Tensor, unit_bytes: int, topology) -> torch.Tensor:
    """`transfer_fs` before its maxima: int64[4, ..., R], the femtoseconds of every rank's NVLink out, NVLink in, NIC
    out and NIC in (`LinkLoads` order), every flow at the topology's integer per-byte cost."""
    topo = topology.on(counts.device)
    off = ~torch.eye(counts.shape[-1], dtype=torch.bool, device=counts.device)
    fs = counts.to(torch.int64) * int(unit_bytes) * topo.cost_fs * off
    return torch.stack(_link_sums(fs, topo.domain_of))


LINK_STAT_NAMES = (
    "t_dispatch_link",  # seconds of one dispatch at its busiest link (the combine mirrors it)
    "t_fetch_link",  # seconds of one replica fetch at its busiest link (the reload repeats it, the return mirrors it)
    "dispatch_nic_max_bytes",  # the busiest NIC's bytes in one dispatch (either direction)
    "dispatch_nvlink_max_bytes",  # the busiest NVLink port's bytes in one dispatch
    "fetch_nic_max_bytes",
    "fetch_nvlink_max_bytes",
    "replica_max_sends",  # the most replica copies one rank sends in one fetch (its fan-out)
    "t_link_total",  # 2 dispatch-like transfers per pass (dispatch + combine), 2 passes, plus 2 fetches and a return
)


def link_stats(plan: Plan) -> torch.Tensor:
    """float64[len(LINK_STAT_NAMES)] on the plan's device, in LINK_STAT_NAMES order. No host synchronisation.
    t_link_total is the per-link counterpart of eq. 6 + 7's t_token + t_replica: forward and backward each dispatch
    and combine (4 token transfers), the replicas are fetched twice (forward, backward reload) and their gradients
    return once, every transfer at its busiest link and none overlapping another."""
    copies = replica_matrix(plan)
    dispatch = token_matrix(plan).double() * float(plan.token_bytes)
    fetch = copies.double() * float(plan.expert_bytes)
    dom = plan.topology.domain_of
    t_d, t_f = transfer_seconds(dispatch, plan.topology), transfer_seconds(fetch, plan.topology)
    d_nvl, d_nic = link_loads(dispatch, dom).busiest()
    f_nvl, f_nic = link_loads(fetch, dom).busiest()
    sends = (copies - torch.diag(torch.diagonal(copies))).sum(1).max().double()
    return torch.stack([t_d, t_f, d_nic, d_nvl, f_nic, f_nvl, sends, 4 * t_d + 3 * t_f]).to(torch.float64)
