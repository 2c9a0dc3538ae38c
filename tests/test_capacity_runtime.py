"""Multi-rank CPU tests (gloo) of the capacity-bounded layer: backend cuda's code on the CPU harness
(test_cuda_backend_cpu.harness: its receive regions sized by the capacity, the planner's capacity step, the spill
path with the torch references of its kernels) and backend torch, against an fp64 reference, on adversarial routing at EP 2-16 as 1-4
domains: every token of every rank on one expert; on one rank's experts; on one domain's experts; zero tokens on
some ranks; uneven token counts. Outputs and all gradients within 2x backend torch's bf16 error, both backends with
the same plan, and the capacity respected (region loads) or the rows beyond it spilled and counted
(`capacity_overflow`). Three cases have too few slots (0 or 1) on purpose, and rows spill; with 2 slots none does."""

import pytest
import torch

from distributed import run_ranks
from test_cuda_backend_cpu import harness

E_LOC, T, K, H, FD = 8, 48, 4, 64, 32


def _dense(x, idx, w, fc1, fc2, gy):
    """fp64 reference of one rank's layer: y and the gradients of x, w, fc1, fc2 (all experts)."""
    x, w, fc1, fc2 = (t.double().requires_grad_() for t in (x, w, fc1, fc2))
    h = torch.einsum("th,tkfh->tkf", x, fc1[idx])
    act = torch.nn.functional.silu(h[..., :FD]) * h[..., FD:]
    y = (torch.einsum("tkf,tkhf->tkh", act, fc2[idx]) * w[..., None]).sum(1)
    (y * gy.double()).sum().backward()
    return [t.detach() for t in (y, x.grad, w.grad, fc1.grad, fc2.grad)]


def _tokens(world, kind):
    """Tokens per rank: zero on every other rank from rank 1 ("zero"), or varied ("uneven")."""
    if kind == "zero":
        return [0 if r % 2 else T for r in range(world)]
    if kind == "uneven":
        return [(T, T // 3, 1, T - 5)[r % 4] for r in range(world)]
    return [T] * world


def _routing(world, rpd, kind, seed):
    """Every rank's (x, topk_idx, weights, grad_y) for one kind of routing (module docstring)."""
    E = world * E_LOC
    g = torch.Generator().manual_seed(seed)
    pool = {"one_rank": E_LOC, "one_domain": E_LOC * rpd}.get(kind, E)
    out = []
    for n in _tokens(world, kind):
        logits = torch.randn(n, E, generator=g)
        logits[:, pool:] -= 1e4  # only the pool's experts can be chosen
        if kind == "one_expert":
            logits[:, 0] += 1e4  # every token chooses expert 0 (and k - 1 others)
        idx = torch.topk(logits, K, dim=1).indices
        w = torch.softmax(torch.randn(n, K, generator=g), 1)
        out.append((torch.randn(n, H, generator=g), idx, w, torch.randn(n, H, generator=g)))
    return out


def _experts(world, g=None):
    """Every expert's (fc1, fc2), the same on every rank (drawn from g, default a generator seeded 5)."""
    E = world * E_LOC
    g = g or torch.Generator().manual_seed(5)
    return torch.randn(E, 2 * FD, H, generator=g) * 0.05, torch.randn(E, H, FD, generator=g) * 0.05


def _layer(rank, world, rpd, fc1, fc2, **kw):
    """This rank's ExpertParallelMoE (bf16 on the CPU; backend cuda's max_tokens T) with its experts of fc1, fc2."""
    from topoep import ExpertParallelMoE, Topology

    lo, hi = rank * E_LOC, (rank + 1) * E_LOC
    layer = ExpertParallelMoE(num_experts=world * E_LOC, hidden_size=H, ffn_hidden_size=FD,
                              topology=Topology(num_domains=world // rpd, ranks_per_domain=rpd), dtype=torch.bfloat16,
                              device="cpu", max_tokens=T if kw.get("backend") == "cuda" else None, **kw)
    with torch.no_grad():
        layer.fc1.copy_(fc1[lo:hi])
        layer.fc2.copy_(fc2[lo:hi])
    return layer


def _run(rank, world, rpd, kind, slots, chunks):
    from topoep.planners.capacity import region_loads
    from topoep.runtime.a2a import A2AWorkspace

    lo, hi = rank * E_LOC, (rank + 1) * E_LOC
    fc1, fc2 = _experts(world)
    data = _routing(world, rpd, kind, 7)
    refs = [_dense(*d[:3], fc1, fc2, d[3]) for d in data]
    ref = [refs[rank][0], refs[rank][1], refs[rank][2], sum(r[3] for r in refs)[lo:hi], sum(r[4] for r in refs)[lo:hi]]
    x, idx, w, gy = data[rank]
    out = {}
    for backend in ("torch", "cuda"):
        layer = _layer(rank, world, rpd, fc1, fc2, num_slots=slots, policy="topoep", backend=backend, guard=False,
                       **harness(backend, chunks))  # backend cuda's token chunks: a receive region each
        xr, wr = x.to(torch.bfloat16).requires_grad_(), w.to(torch.bfloat16).requires_grad_()
        y = layer(xr, idx, wr)
        (y * gy.to(torch.bfloat16)).sum().backward()
        errs = [float((a.double() - b).abs().max()) if a.numel() else 0.0
                for a, b in zip((y, xr.grad, wr.grad, layer.fc1.grad, layer.fc2.grad), ref)]
        loads = region_loads(layer.last_plan)
        spilled = sum(int(ws.spilled_rows) for ws in A2AWorkspace._shared.values()) if backend == "cuda" else 0
        out[backend] = (errs, layer.stats_dict(), int(loads.max()), layer.last_plan.route.tolist(), spilled)
    return out


CASES = [  # (world, ranks per domain, routing, slots)
    (2, 2, "one_expert", 2), (2, 1, "one_rank", 2), (2, 2, "one_rank", 1), (2, 2, "one_rank", 0),
    (4, 2, "one_domain", 2), (4, 4, "zero", 2), (4, 2, "uneven", 1), (4, 1, "one_expert", 2),
    pytest.param(8, 4, "one_rank", 2, marks=pytest.mark.slow), pytest.param(8, 2, "one_domain", 1, marks=pytest.mark.slow),
    pytest.param(16, 4, "one_expert", 2, marks=pytest.mark.slow),
    pytest.param(16, 4, "one_domain", 2, marks=pytest.mark.slow),
]
SPILLS = {(2, 2, "one_rank", 1), (2, 2, "one_rank", 0), (8, 2, "one_domain", 1)}  # too few slots: rows spill


@pytest.mark.parametrize("world, rpd, kind, slots", CASES)
def test_capacity_on_adversarial_routing(world, rpd, kind, slots):
    _check(world, rpd, kind, slots, 1, (world, rpd, kind, slots) in SPILLS)


@pytest.mark.parametrize("world, rpd, kind, slots, spills", [(4, 4, "one_rank", 0, True), (4, 2, "uneven", 1, False),
                                                            (4, 2, "one_expert", 1, False)])
def test_capacity_with_two_chunks(world, rpd, kind, slots, spills):
    """Two chunks of tokens, a region each: chunk 1's spilled rows are staged after chunk 0's rows."""
    _check(world, rpd, kind, slots, 2, spills)


def _check(world, rpd, kind, slots, chunks, spills):
    cap = int(1.25 * T * K)  # the default capacity_factor; max_tokens T on every rank
    spilled = 0
    for out in run_ranks(_run, world, rpd, kind, slots, chunks):
        (errs_t, stats_t, _, route_t, _), (errs_c, stats_c, top, route_c, rows) = out["torch"], out["cuda"]
        spilled += rows
        assert route_c == route_t  # the same plan, capacity step included
        for what, ec, et in zip(("y", "grad x", "grad w", "grad fc1", "grad fc2"), errs_c, errs_t):
            assert ec <= 2 * et + 1e-6, f"{what}: error {ec:.3g} > 2 x torch's {et:.3g}"
        overflow = stats_c["capacity_overflow"]
        assert overflow == stats_t["capacity_overflow"]
        # the capacity is respected, or what is beyond it is counted (and was computed on the spill path: the
        # outputs above are right)
        assert (top <= cap and overflow == 0) or (top > cap and overflow > 0), (top, overflow)
        assert (overflow > 0) == spills, overflow
    # the rows beyond the regions were received on the spill path: with one chunk exactly those beyond the capacity
    # (summed over the ranks); each of two chunks has a region of its own, which holds its rows of the call
    assert (spilled > 0) == spills and (chunks == 2 or spilled == overflow), (spilled, overflow)


def _hint(rank, world, kind):
    """Backend cuda's slot hint with the capacity step: a topoep layer whose guard always fires and the static layer,
    4 calls. Where the static plan overflows the regions ("one_rank"), the capacity step places replicas in both, so
    the hint keeps the replica machinery; where it fits ("uniform"), calls 3-4 leave it out (lag 2). Both equal the
    static layer bit for bit."""
    from topoep.runtime import NetBenefitGuard

    E = world * E_LOC
    g = torch.Generator().manual_seed(5)
    fc1, fc2 = _experts(world, g)  # the routing below draws from g after them
    layers = {name: _layer(rank, world, world, fc1, fc2, num_slots=2, policy=policy, backend="cuda", guard=guard,
                           _cpu_harness=True)
              for name, policy, guard in (("static", "static", False),
                                          ("fires", "topoep", NetBenefitGuard(plan_s=1.0)))}
    same, moves = [], []
    for call in range(4):
        if kind == "uniform":
            idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        else:
            idx = _routing(world, 1, kind, 30 + call)[rank][1]
        x = torch.randn(T, H, generator=g).to(torch.bfloat16)
        w = torch.softmax(torch.randn(T, K, generator=g), 1).to(torch.bfloat16)
        ys = [layer(x, idx, w).detach() for layer in layers.values()]
        same.append(torch.equal(*ys))
        moves.append(layers["fires"].stats_dict()["capacity_moves"])
    return same, layers["fires"].slot_hint.skipped, layers["static"].slot_hint.skipped, moves


@pytest.mark.parametrize("kind, skips", [("one_rank", 0), ("uniform", 2)])
def test_the_slot_hint_keeps_the_slots_the_capacity_step_uses(kind, skips):
    for same, skipped, skipped_static, moves in run_ranks(_hint, 2, kind):
        assert all(same), same
        assert skipped == skipped_static == skips, (skipped, skipped_static, moves)
        assert all(m > 0 for m in moves) == (kind == "one_rank"), moves


def _unplanned(rank, world):
    """Backend cuda (CPU harness), a guarded topoep_plus layer with the slot hint (lag 2; a guard of no planning or
    latency cost): exactly even routing for 4 calls, then skewed routing for 4. Which policies each call solved (the
    planners are counted) and its statistics."""
    from topoep.runtime import NetBenefitGuard, moe

    solved = []
    real_solve, real_concurrent = moe.solve, moe.plan_concurrently

    def counting_solve(omega, topology, policy="topoep", **kw):
        solved[-1].append(policy)
        return real_solve(omega, topology, policy=policy, **kw)

    def counting_concurrent(omega, topology, policies, kw):
        solved[-1].extend(policies)
        return real_concurrent(omega, topology, policies, kw)

    moe.solve, moe.plan_concurrently = counting_solve, counting_concurrent
    try:
        E = world * E_LOC
        g = torch.Generator().manual_seed(5)
        fc1, fc2 = _experts(world, g)
        layer = _layer(rank, world, world, fc1, fc2, num_slots=2, policy="topoep_plus", backend="cuda",
                       guard=NetBenefitGuard(plan_s=0.0, transfer_latency_s=0.0), capacity_factor=None,
                       _cpu_harness=True)
        stats = []
        for call in range(8):
            solved.append([])
            if call < 4:  # every expert exactly equally often: no plan can pay
                idx = (torch.arange(T * K).view(T, K) + call) % E
            else:  # every token on rank 0's experts: planning pays
                idx = torch.stack([torch.randperm(E_LOC, generator=g)[:K] for _ in range(T)])
            x = torch.randn(T, H, generator=g).to(torch.bfloat16)
            w = torch.softmax(torch.randn(T, K, generator=g), 1).to(torch.bfloat16)
            layer(x, idx, w)
            s = layer.stats_dict()
            stats.append((s["slot_skipped"], s["guard_wanted"], s["plan_skipped"], s["guard_saved_ms"],
                          s["guard_cost_ms"], s["num_replicas"]))
        return solved, stats
    finally:
        moe.solve, moe.plan_concurrently = real_solve, real_concurrent


def test_a_call_the_slot_hint_left_out_plans_nothing():
    """Calls 3-4 (uniform, the hint skips): only the static plan is made, nothing priced, wanted = the bound's
    verdict (no). Calls 5-6 (skewed) are skipped too (lag 2) but their bound says a plan may pay, so calls 7-8 plan
    (topoep_plus alone: one NVLink domain, where its local candidate is the same plan), the guard decides and replicas
    run."""
    for solved, stats in run_ranks(_unplanned, 2):
        plus = ["topoep_plus"]
        assert solved == [plus, plus, ["static"], ["static"], ["static"], ["static"], plus, plus], solved
        for skipped, wanted, plan_skipped, saved, cost, replicas in stats[2:4]:
            assert (skipped, wanted, plan_skipped, saved, cost, replicas) == (1.0, 0.0, 1.0, 0.0, 0.0, 0.0)
        for skipped, wanted, plan_skipped, saved, cost, replicas in stats[4:6]:
            assert (skipped, wanted, plan_skipped, replicas) == (1.0, 1.0, 0.0, 0.0)
        for skipped, wanted, plan_skipped, saved, cost, replicas in stats[6:]:
            assert skipped == 0.0 and plan_skipped == 0.0 and saved > cost and wanted == 1.0 and replicas > 0


def _hint_returns(rank, world):
    """The static layer with the slot hint (lag 2): 4 calls of routing that fits the regions (the hint leaves the
    slots out from call 3 on), then 4 that overflow them. Per call: capacity_overflow, capacity_moves, slot_skipped."""
    E = world * E_LOC
    g = torch.Generator().manual_seed(5)
    fc1, fc2 = _experts(world, g)
    layer = _layer(rank, world, world, fc1, fc2, num_slots=2, policy="static", backend="cuda", guard=False,
                   _cpu_harness=True)
    out = []
    for call in range(8):
        if call < 4:
            idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        else:
            idx = _routing(world, 1, "one_rank", 30 + call)[rank][1]
        x = torch.randn(T, H, generator=g).to(torch.bfloat16)
        w = torch.softmax(torch.randn(T, K, generator=g), 1).to(torch.bfloat16)
        layer(x, idx, w)
        s = layer.stats_dict()
        out.append((s["capacity_overflow"], s["capacity_moves"], s["slot_skipped"]))
    return out


def test_the_slot_hint_brings_the_slots_back_when_rows_spill():
    """Rows spilled while the slot hint had left the slots out ask for them again: lag calls later the capacity step
    places replicas and nothing spills (they used to stay out, every later call spilling)."""
    for out in run_ranks(_hint_returns, 2):
        overflow, moves, skipped = zip(*out)
        assert skipped[2:6] == (1.0,) * 4 and overflow[4] > 0 and overflow[5] > 0, out  # the hint of calls 2-3
        assert skipped[6:] == (0.0, 0.0) and overflow[6:] == (0.0, 0.0) and min(moves[6:]) > 0, out


def test_a_huge_capacity_factor_is_the_worst_case():
    """capacity_rows never exceeds what a region can receive (R x T x top_k), so any finite capacity_factor keeps the
    capacity step in its integer range: 1e17 plans as no capacity would."""
    from topoep import Topology, solve
    from topoep.runtime.backend import capacity_rows, receive_regions

    assert capacity_rows(1024, 1e17, 8) == 8 * 1024 and capacity_rows(1024, 1.25, 8) == 1280
    assert receive_regions(8, 1024, 8, 1, 1e17) == ([8 * 1024], False)
    omega = torch.zeros(4, 8, dtype=torch.int64)
    omega[:, 0] = 64
    plain = solve(omega, Topology(num_domains=1, ranks_per_domain=4), num_slots=2, policy="topoep")
    fitted = solve(omega, Topology(num_domains=1, ranks_per_domain=4), num_slots=2, policy="topoep",
                   capacity=capacity_rows(64, 1e17, 4))
    assert fitted.info["capacity"]["overflow"] == 0 and torch.equal(fitted.route, plain.route)
