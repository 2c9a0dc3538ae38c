"""The plan statistics of every backend-cuda call (`topoep.metrics.plan_stats`, its reference) as one Triton kernel.

plan_stats is about 70 small torch operations on tensors of a few thousand elements; backend cuda computes it in
every call's metadata graph (on a side stream). Here one program does it: a pass over the route's rows (token
totals, inter- and intra-domain assignments, the token cost), the rank loads from the instance loads (the default
placement: rank r hosts main experts r E_loc .. (r + 1) E_loc - 1 and slots r N .. (r + 1) N - 1, read back from a
scratch row after a barrier of the program), and the replicas. The counts are integers, exact in float64 in any
order; the cost sums (t_token, t_replica) sum in another order than the reference: equal to it within 1e-12
relative.
"""

from __future__ import annotations

import torch

from topoep.metrics import STAT_NAMES, plan_stats
from topoep.plan import Plan, default_main_rank

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only environments: the module imports, the kernel is unavailable
    triton = None

if triton is not None:

    @triton.jit
    def _plan_stats_kernel(route, omega, slot_expert, dom, cost, consts, scratch, out, R, E, N, P, E_loc,
                           BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
                           BLOCK_RN: tl.constexpr):
        """out float64[15] in STAT_NAMES order (topoep.metrics.plan_stats); consts float64[3]: token bytes, expert
        bytes, t_ffn (in float64: a Python float argument would be fp32); scratch float64[>= P + E]."""
        S = tl.load(consts + 0)
        W = tl.load(consts + 1)
        t_ffn = tl.load(consts + 2)
        pv = tl.arange(0, BLOCK_P)
        pm = pv < P
        irv = tl.where(pv < E, pv // E_loc, (pv - E) // tl.maximum(N, 1))  # each instance's rank
        dom_ir = tl.load(dom + irv, mask=pm, other=0)
        colsum = tl.zeros([BLOCK_P], dtype=tl.float64)
        inter = tl.zeros([BLOCK_P], dtype=tl.float64)
        intra = tl.zeros([BLOCK_P], dtype=tl.float64)
        tok = tl.zeros([BLOCK_P], dtype=tl.float64)
        s = 0
        while s < R:  # (while loops: Triton's interpreter runs them, not ranges over runtime bounds)
            row = tl.load(route + s * P + pv, mask=pm, other=0).to(tl.float64)
            colsum += row
            cross = dom_ir != tl.load(dom + s)
            inter += tl.where(cross, row, 0.0)
            intra += tl.where((irv != s) & (~cross), row, 0.0)
            tok += row * tl.load(cost + s * R + irv, mask=pm, other=0.0)
            s += 1
        total = tl.sum(colsum, 0)
        denom = tl.maximum(total, 1.0)
        served = tl.sum(tl.where(pv >= E, colsum, 0.0), 0)
        # rank loads: the instance loads back from scratch, summed per rank (contiguous instances)
        ev = tl.arange(0, BLOCK_E)
        em = ev < E
        osum = tl.zeros([BLOCK_E], dtype=tl.float64)
        s = 0
        while s < R:
            osum += tl.load(omega + s * E + ev, mask=em, other=0).to(tl.float64)
            s += 1
        tl.store(scratch + pv, colsum, mask=pm)
        tl.store(scratch + P + ev, osum, mask=em)
        tl.debug_barrier()
        rv = tl.arange(0, BLOCK_R)
        rm = rv < R
        load = tl.zeros([BLOCK_R], dtype=tl.float64)
        load0 = tl.zeros([BLOCK_R], dtype=tl.float64)
        j = 0
        while j < E_loc:
            load += tl.load(scratch + rv * E_loc + j, mask=rm, other=0.0)
            load0 += tl.load(scratch + P + rv * E_loc + j, mask=rm, other=0.0)
            j += 1
        j = 0
        while j < N:
            load += tl.load(scratch + E + rv * N + j, mask=rm, other=0.0)
            j += 1
        lmax = tl.max(tl.where(rm, load, 0.0), 0)
        mean = tl.sum(load, 0) / R
        l0max = tl.max(tl.where(rm, load0, 0.0), 0)
        l0mean = tl.maximum(tl.sum(load0, 0) / R, 1e-30)
        imb = tl.where(mean > 0, lmax / tl.maximum(mean, 1e-30), 1.0)
        imb0 = tl.where(mean > 0, l0max / l0mean, 1.0)
        # replicas
        qv = tl.arange(0, BLOCK_RN)
        qm = qv < R * N
        se = tl.load(slot_expert + qv, mask=qm, other=-1)
        occupied = se >= 0
        rep_rank = qv // tl.maximum(N, 1)
        rep_main = tl.maximum(se, 0) // E_loc
        rep_cross = occupied & (tl.load(dom + rep_rank, mask=qm, other=0) != tl.load(dom + rep_main, mask=qm, other=0))
        n_rep = tl.sum(occupied.to(tl.float64), 0)
        n_rep_cross = tl.sum(rep_cross.to(tl.float64), 0)
        t_replica = W * tl.sum(tl.where(occupied, tl.load(cost + rep_main * R + rep_rank, mask=qm, other=0.0), 0.0), 0)
        inter_sum = tl.sum(inter, 0)
        t_comp = t_ffn * lmax
        t_token = 2 * S * tl.sum(tok, 0)
        tl.store(out + 0, imb)
        tl.store(out + 1, lmax)
        tl.store(out + 2, mean)
        tl.store(out + 3, imb0)
        tl.store(out + 4, inter_sum / denom)
        tl.store(out + 5, served / denom)
        tl.store(out + 6, n_rep)
        tl.store(out + 7, 4 * S * inter_sum)
        tl.store(out + 8, 4 * S * tl.sum(intra, 0))
        tl.store(out + 9, 3 * W * n_rep_cross)
        tl.store(out + 10, 3 * W * (n_rep - n_rep_cross))
        tl.store(out + 11, t_comp)
        tl.store(out + 12, t_token)
        tl.store(out + 13, t_replica)
        tl.store(out + 14, t_comp + t_token + t_replica)


def _pow2(n: int) -> int:
    from topoep.runtime.symm import _pow2 as p2

    return max(2, p2(n))


def usable(plan: Plan) -> bool:
    """The kernel applies: a plan on the GPU with the default placement (the runtime's: its cached main_rank)."""
    return (triton is not None and plan.route.is_cuda
            and plan.main_rank is default_main_rank(plan.num_experts, plan.num_ranks, plan.omega.device))


_CONSTS: dict = {}


def _consts(token_bytes: int, expert_bytes: int, t_ffn: float, device) -> torch.Tensor:
    """float64[3] on the device, made once per value (the metadata graph's capture then copies nothing from the
    host)."""
    key = (float(token_bytes), float(expert_bytes), float(t_ffn), torch.device(device))
    t = _CONSTS.get(key)
    if t is None:
        t = _CONSTS[key] = torch.tensor(key[:3], dtype=torch.float64, device=device)
    return t


def plan_stats_triton(plan: Plan, t_ffn: float) -> torch.Tensor:
    """float64[len(STAT_NAMES)]: topoep.metrics.plan_stats of a plan with the default placement, in one kernel."""
    R, E, N = plan.num_ranks, plan.num_experts, plan.num_slots
    dev = plan.route.device
    topo = plan.topology.on(dev)
    P = E + R * N
    out = torch.empty(len(STAT_NAMES), dtype=torch.float64, device=dev)
    scratch = torch.empty(P + E, dtype=torch.float64, device=dev)
    _plan_stats_kernel[(1,)](plan.route.contiguous(), plan.omega.contiguous(), plan.slot_expert.contiguous(),
                             topo.domain_of, topo.cost.contiguous(),
                             _consts(plan.token_bytes, plan.expert_bytes, t_ffn, dev), scratch, out, R, E, N, P,
                             E // R, BLOCK_P=_pow2(P), BLOCK_R=_pow2(R), BLOCK_E=_pow2(E), BLOCK_RN=_pow2(R * N))
    return out


def stats(plan: Plan, t_ffn: float) -> torch.Tensor:
    """plan_stats, by the kernel where it applies (usable), else by the reference."""
    return plan_stats_triton(plan, t_ffn) if usable(plan) else plan_stats(plan, t_ffn)
