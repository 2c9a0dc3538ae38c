"""Plan metrics: balance, locality, bytes moved, and the modelled cost terms of eq. 5-8.

`plan_stats` computes everything as one float64 tensor on the plan's device (no host sync; the runtime
logs it every N steps); `metrics` returns the same numbers as a dict of Python floats.
"""

from __future__ import annotations

import torch

from topoep.links import LINK_STAT_NAMES, link_stats
from topoep.plan import Plan

# Forward + backward FLOPs of one token through one SwiGLU expert (3 matrices H x F):
# forward 2 * 3 * H * F, backward twice that.
FLOPS_PER_ASSIGNMENT_FACTOR = 18


def ffn_time_per_assignment(hidden_size: int, ffn_hidden_size: int, flops_per_s: float = 4.0e14) -> float:
    """t_FFN: seconds of expert compute per token-expert assignment, forward + backward.

    `flops_per_s` is the effective grouped-GEMM throughput; the default 400 TFLOP/s is about 40 % of an
    H800/H100's dense BF16 peak, typical for expert GEMMs of a few hundred to a few thousand rows.
    Calibrate it from a measured MoE layer: t_ffn = measured expert time on a rank / its assignments.
    """
    return FLOPS_PER_ASSIGNMENT_FACTOR * hidden_size * ffn_hidden_size / flops_per_s


DEFAULT_T_FFN = ffn_time_per_assignment(2048, 768)  # Qwen3-30B-A3B expert: ~70.8 ns

STAT_NAMES = (
    "imbalance",  # max / mean rank load (1.0 = perfect)
    "max_load",  # L_max
    "mean_load",
    "static_imbalance",  # max / mean rank load with main instances only (before balancing)
    "internode_fraction",  # share of assignments executed in another domain than their source
    "replica_fraction",  # share of assignments executed by a replica
    "num_replicas",
    "token_bytes_inter",  # dispatch + combine, forward + backward (4 transfers per assignment)
    "token_bytes_intra",  # same, between different ranks of one domain
    "replica_bytes_inter",  # 2 fetches (forward, backward reload) + 1 gradient return per replica
    "replica_bytes_intra",
    "t_comp",  # eq. 5: t_ffn * L_max  (seconds)
    "t_token",  # eq. 6: 2 S_tok sum c[s, r] q[s, e, r]
    "t_replica",  # eq. 7: sum over replicas c[main(e), r] W
    "t_total",  # eq. 8
)


def plan_stats(plan: Plan, t_ffn: float = DEFAULT_T_FFN) -> torch.Tensor:
    """float64[len(STAT_NAMES)] on the plan's device, in STAT_NAMES order. No host synchronisation."""
    dev = plan.omega.device
    R = plan.num_ranks
    topo = plan.topology.on(dev)
    dom = topo.domain_of
    cost = topo.cost
    route = plan.route.double()
    ir = plan.instance_rank
    E = plan.num_experts
    L = plan.rank_load.double()
    total = route.sum()
    denom = total.clamp(min=1)
    mean = L.mean()
    imb = torch.where(mean > 0, L.max() / mean.clamp(min=1e-30), torch.ones((), dtype=torch.float64, device=dev))
    L0 = torch.zeros(R, dtype=torch.float64, device=dev).index_add_(0, plan.main_rank, plan.omega.sum(0).double())
    imb0 = torch.where(mean > 0, L0.max() / L0.mean().clamp(min=1e-30), torch.ones((), dtype=torch.float64, device=dev))
    src = torch.arange(R, device=dev)
    cross = dom[src][:, None] != dom[ir][None, :]  # [R, P]
    remote = src[:, None] != ir[None, :]
    inter = (route * cross).sum()
    intra = (route * (remote & ~cross)).sum()
    S, W = float(plan.token_bytes), float(plan.expert_bytes)
    occupied = (plan.slot_expert >= 0).reshape(-1)
    rep_rank = ir[E:]
    rep_main = plan.main_rank[plan.slot_expert.reshape(-1).clamp(min=0)]
    rep_cross = occupied & (dom[rep_rank] != dom[rep_main])
    n_rep = occupied.sum().double()
    n_rep_cross = rep_cross.sum().double()
    t_comp = t_ffn * L.max()
    t_token = 2 * S * (route * cost[src][:, ir]).sum()
    t_replica = (W * cost[rep_main, rep_rank] * occupied).sum()
    return torch.stack([
        imb, L.max(), mean, imb0, inter / denom, route[:, E:].sum() / denom, n_rep,
        4 * S * inter, 4 * S * intra, 3 * W * n_rep_cross, 3 * W * (n_rep - n_rep_cross),
        t_comp, t_token, t_replica, t_comp + t_token + t_replica,
    ]).to(torch.float64)


def metrics(plan: Plan, t_ffn: float = DEFAULT_T_FFN) -> dict[str, float]:
    """Imbalance, inter-node and replica-served fractions, bytes moved and the modelled cost terms of
    eq. 5-8 (seconds, for `t_ffn` seconds of expert time per assignment), then the per-link terms of
    `topoep.links` (the busiest NVLink port's and NIC's bytes and time per phase, the largest replica fan-out), as
    Python floats."""
    return dict(zip(STAT_NAMES, plan_stats(plan, t_ffn).tolist())) | dict(zip(LINK_STAT_NAMES, link_stats(plan).tolist()))


def fit_t_ffn(assignments, seconds, *, intercept: bool = True) -> tuple[float, float]:
    """Calibrate t_FFN from a measured MoE layer: (t_ffn, overhead) in seconds.

    assignments[i]: token-expert assignments executed by the straggler rank in measurement i (L_max);
    seconds[i]: that rank's measured expert time (grouped GEMMs forward + backward, the `experts`
    phase of bench/moe_layer.py). Least squares of seconds = overhead + t_ffn * assignments; with
    intercept=False the line goes through the origin (overhead 0). Use measurements at several loads
    (e.g. balanced and skewed routing, two token counts): the slope is what the planners need, since
    they compare loads, and the overhead (kernel launches, small-GEMM inefficiency) is paid whatever
    the plan. Pass the result as `solve(..., t_ffn=t_ffn)`.
    """
    x = torch.as_tensor(assignments, dtype=torch.float64).flatten()
    y = torch.as_tensor(seconds, dtype=torch.float64).flatten()
    if x.numel() != y.numel() or x.numel() < (2 if intercept else 1):
        raise ValueError(f"fit_t_ffn needs as many times as loads, at least {2 if intercept else 1}; got "
                         f"{x.numel()} loads and {y.numel()} times")
    if (x < 0).any() or (y < 0).any() or not torch.isfinite(x).all() or not torch.isfinite(y).all():
        raise ValueError("fit_t_ffn: loads and times must be finite and >= 0")
    if intercept:
        xm, ym = x.mean(), y.mean()
        var = ((x - xm) ** 2).sum()
        if var == 0:
            raise ValueError("fit_t_ffn with intercept needs measurements at two different loads at least")
        slope = float(((x - xm) * (y - ym)).sum() / var)
        overhead = float(ym - slope * xm)
    else:
        slope, overhead = float((x * y).sum() / (x * x).sum().clamp(min=1e-300)), 0.0
    if not slope > 0:
        raise ValueError(f"fit_t_ffn: the measured time does not grow with the load (slope {slope:.3g} s per "
                         "assignment); measure at more different loads")
    return slope, overhead
