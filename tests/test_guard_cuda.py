"""The net-benefit guard's CUDA kernel (csrc/guard.cu, topoep/runtime/guard_cuda.py) against its reference
(`NetBenefitGuard.select` on torch, `topoep.relay.executed_sources`): bit for bit on random plans, topologies and guard
constants, on the GPU's torch reference and on the CPU's (what the simulator runs); no host synchronisation; CUDA-graph
replay equal to eager. The GPU tests skip without CUDA (run them on the GPU machine: tools/gpu_session.sh guard);
the CPU tests check when the kernel applies."""

import random

import pytest
import torch

from topoep import Topology, solve
from topoep.relay import executed_sources, relay_sources
from topoep.runtime import guard_cuda
from topoep.runtime.guard import NetBenefitGuard
from topoep.workloads import biased_routing

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)")

POLICIES = ("topoep_plus", "topoep_plus_local", "topoep")


def plans_of(seed: int):
    """(plans of one random routing: topoep_plus, its local plan, topoep; on the CPU), varied shapes and skews."""
    rng = random.Random(seed)
    rpd, M = rng.choice([(1, 2), (2, 2), (4, 1), (4, 2), (2, 4), (8, 2), (4, 4), (8, 4)])
    R = rpd * M
    E = R * rng.choice([2, 4, 8])
    N = rng.choice([1, 2, 3])
    T, k = rng.choice([64, 512, 4096]), min(E, rng.choice([2, 4, 8]))
    omega = biased_routing(R, E, T, k, rng.choice([0.0, -1.0, -3.0, -6.0]), seed=seed)
    if rng.random() < 0.2:
        omega[rng.randrange(R)] = 0  # a rank without tokens
    topo = Topology(num_domains=M, ranks_per_domain=rpd, intra_cost=1 / rng.choice([155e9, 287e9, 200e9]),
                    inter_cost=1 / rng.choice([45e9, 50e9, 90e9]))
    W, S = rng.choice([(1 << 20, 4096), (9437184, 4096), (3 << 20, 8192)])
    return [solve(omega, topo, num_slots=N, policy=p, expert_bytes=W, token_bytes=S, backend="reference")
            for p in POLICIES], rng


def guards(rng):
    yield NetBenefitGuard()
    yield NetBenefitGuard(relay_fanout=2, relay_chunks=rng.choice([1, 4]), relay_share=rng.choice([False, True]))
    yield NetBenefitGuard(relay_fanout=1, token_overlap=0.0, transfer_latency_s=0.0, relay_chunks=rng.choice([1, 3]),
                          relay_share=True)
    yield NetBenefitGuard(relay_fanout=3, token_transfers=0, plan_s=0.0, relay_chunks=rng.choice([2, 64]))
    fanout = rng.choice([None, 2])
    yield NetBenefitGuard(bytes_per_s=rng.choice([25e9, 100e9]), relay_fanout=fanout, token_overlap=rng.random(),
                          relay_chunks=rng.choice([1, 5]) if fanout else 1)
    yield NetBenefitGuard(token_chunks=rng.choice([1, 2, 3, 64]), relay_fanout=rng.choice([None, 2]))
    yield NetBenefitGuard(token_chunks=2, token_transfers=0, plan_s=0.0)
    # copy by copy (relay_schedule "async": the longer of the busiest link over all levels and the longest chain)
    yield NetBenefitGuard(relay_fanout=rng.choice([1, 2, 3]), relay_schedule="async", relay_share=rng.choice([False, True]),
                          transfer_latency_s=rng.choice([0.0, 2e-5]))
    # the forward fetch beside the dispatch (fetch_overlap: the forward's wait for it, links.overlapped_forward_s)
    yield NetBenefitGuard(fetch_overlap=True, token_chunks=rng.choice([None, 1, 2, 3]),
                          relay_fanout=rng.choice([None, 2]), relay_share=rng.choice([False, True]))
    yield NetBenefitGuard(fetch_overlap=True, token_chunks=2, relay_fanout=rng.choice([1, 2]), relay_schedule="async",
                          token_transfers=rng.choice([0, 4]), transfer_latency_s=rng.choice([0.0, 2e-5]))


def to(plan, device):
    import dataclasses

    return dataclasses.replace(plan, omega=plan.omega.to(device), slot_expert=plan.slot_expert.to(device),
                               route=plan.route.to(device), main_rank=plan.main_rank.to(device))


def outputs(executed, fired, saved, cost, relay_flag: bool):
    out = [executed.slot_expert, executed.route, executed.info["guard_choice"], fired, saved, cost]
    if relay_flag:
        out.append(executed.info["relay"])
    return [t.cpu() for t in out]


# (allow, planned) of the guard: no flag, the host's allow either way, the planners' flag either way, both
FLAGS = ((None, None), (True, None), (False, None), (None, True), (None, False), (True, False), (False, True))


def test_unplanned_call_prices_nothing_and_runs_static():
    """planned False (the planners left the call out): the static plan runs, choice 0, no relayed fetch, T_saved =
    T_plan + T_transfer = 0, whatever the plans say; planned True is the same as no flag."""
    for seed in range(6):
        plans, rng = plans_of(seed)
        for guard in guards(rng):
            relay_flag = guard.relay_fanout is not None
            args = dict(t_ffn=2e-7, exposed_transfers=1, candidates=tuple(plans[1:]))
            free = outputs(*guard.select(plans[0], **args), relay_flag)
            assert all(torch.equal(x, y) for x, y in
                       zip(free, outputs(*guard.select(plans[0], **args, planned=torch.tensor(True)), relay_flag)))
            ex, fired, saved, cost = guard.select(plans[0], **args, planned=torch.tensor(False))
            assert bool(fired) and float(saved) == 0.0 and float(cost) == 0.0 and int(ex.info["guard_choice"]) == 0
            assert (ex.slot_expert == -1).all()
            assert torch.equal(ex.route, solve(plans[0].omega, plans[0].topology, num_slots=plans[0].num_slots,
                                               policy="static").route)
            if relay_flag:
                assert not bool(ex.info["relay"])


def test_kernel_applies_to_cuda_plans_with_rows_per_assignment_only():
    plans, _ = plans_of(0)
    assert not guard_cuda.usable(NetBenefitGuard(), tuple(plans))  # CPU plans: the reference
    with pytest.raises(ValueError, match="CUDA kernel needs CUDA plans"):
        NetBenefitGuard().select(plans[0], 1e-6, 1, candidates=tuple(plans[1:]), backend="cuda")
    with pytest.raises(ValueError, match="backend must be"):
        NetBenefitGuard().select(plans[0], 1e-6, 1, backend="gpu")
    meta = [to(p, "meta") for p in plans]
    assert not guard_cuda.usable(NetBenefitGuard(), tuple(meta))
    # the kernel prices relayed fetches level by level and copy by copy
    from types import SimpleNamespace

    cuda_like = SimpleNamespace(route=SimpleNamespace(is_cuda=True), topology=plans[0].topology)
    for schedule in ("levels", "async"):
        assert guard_cuda.usable(NetBenefitGuard(relay_fanout=2, relay_schedule=schedule), (cuda_like,))


@gpu
@pytest.mark.parametrize("chunk", range(4))
def test_guard_kernel_equals_reference(chunk):
    """Random routings x 10 guards (relay trees of 1-3 children in 1-64 chunks or copy by copy, with and without
    relay_share, and the forward fetch beside the dispatch, fetch_overlap, among them) x 3 values of t_ffn x
    {1, 2, 3} plans x the flags (allow, planned) of FLAGS: the
    executed plan, the kept candidate, the fired flag, T_saved, T_plan + T_transfer and the fetch choice are the reference's
    bit for bit, on the GPU's torch reference and on the CPU's; with relays, so are the executed plan's relay trees
    the kernel writes beside them (info["relay_trees"], `executed_sources` of the CPU reference's executed plan)."""
    decisions, trees = set(), 0
    for seed in range(chunk * 12, chunk * 12 + 12):
        cpu_plans, rng = plans_of(seed)
        gpu_plans = [to(p, "cuda") for p in cpu_plans]
        for guard in guards(rng):
            relay_flag = guard.relay_fanout is not None
            for t_ffn in (1e-9, 2e-7, 1e-5):
                for P in (1, 2, 3):
                    for allow, planned in FLAGS:
                        a, pl = (None if f is None else torch.tensor(f) for f in (allow, planned))
                        args = dict(t_ffn=t_ffn, exposed_transfers=rng.choice([1, 3]))
                        on_gpu = dict(allow=None if a is None else a.cuda(), planned=None if pl is None else pl.cuda())
                        got = guard.select(gpu_plans[0], **args, **on_gpu, candidates=tuple(gpu_plans[1:P]),
                                           backend="cuda")
                        ref = guard.select(gpu_plans[0], **args, **on_gpu, candidates=tuple(gpu_plans[1:P]),
                                           backend="reference")
                        host = guard.select(cpu_plans[0], **args, allow=a, planned=pl,
                                            candidates=tuple(cpu_plans[1:P]))
                        g, r, h = (outputs(*x, relay_flag) for x in (got, ref, host))
                        where = f"seed {seed}, {guard}, t_ffn {t_ffn}, {P} plans, allow {allow}, planned {planned}"
                        for i, (x, y, z) in enumerate(zip(g, r, h)):
                            assert torch.equal(x, y), f"output {i} differs from the GPU reference: {where}"
                            assert torch.equal(x, z), f"output {i} differs from the CPU reference: {where}"
                        if relay_flag:  # the executed plan's trees from the same launches: the reference's of it
                            want = torch.stack(executed_sources(host[0], guard.relay_fanout))
                            assert torch.equal(got[0].info["relay_trees"].cpu(), want), f"relay trees differ: {where}"
                            trees += bool((want[1] > 1).any())
                        decisions.add((bool(g[3]), int(g[2]), bool(g[-1]) if relay_flag else None))
    # both decisions, more than one kept candidate and both fetches occur (the cases are not all alike)
    assert {d[0] for d in decisions} == {True, False}
    assert len({d[1] for d in decisions}) > 1
    assert {d[2] for d in decisions} >= {True, False}
    assert trees > 0  # some executed trees relay (a level beyond the home's copies)


def random_slots(R: int, E: int, N: int, main_rank: torch.Tensor, rng: random.Random, hot: int) -> torch.Tensor:
    """A valid slot table: each rank holds distinct experts, or nothing; the `hot` first experts are drawn more often
    (many copies: deep trees), and now and then a rank holds one of its own experts in a slot (as the capacity step
    may place one: copied within the rank, no node of a tree)."""
    slot = torch.full((R, N), -1, dtype=torch.int64)
    for r in range(R):
        choices = [e for e in range(E) if int(main_rank[e]) != r]
        own = [e for e in range(E) if int(main_rank[e]) == r]
        picked = set()
        for j in range(N):
            if rng.random() < 0.2:
                continue
            x = rng.random()
            e = rng.randrange(hot) if x < 0.7 else rng.choice(own) if x < 0.8 and own else rng.choice(choices)
            if e not in picked:
                picked.add(e)
                slot[r, j] = e
    return slot


@gpu
def test_relay_trees_kernel_equals_reference():
    """topoep.relay.executed_sources on the GPU (one kernel) equals the reference on random valid slot tables, fanout
    1-4, with the guard's choice absent, True and False."""
    import dataclasses

    rng = random.Random(7)
    for case in range(200):
        rpd, M = rng.choice([(1, 4), (2, 2), (4, 2), (8, 1), (8, 4), (3, 3), (72, 1)])
        R, N = rpd * M, rng.choice([1, 2, 4])
        E = R * 2
        topo = Topology(num_domains=M, ranks_per_domain=rpd)
        omega = torch.ones(R, E, dtype=torch.int64)
        base = solve(omega, topo, num_slots=N, policy="static", backend="reference")
        slot = random_slots(R, E, N, base.main_rank, rng, hot=rng.choice([1, 2, E]))
        plan = dataclasses.replace(base, slot_expert=slot)
        for fanout in (1, 2, 3, 4):
            for choice in (None, True, False):
                p = dataclasses.replace(plan, info={} if choice is None else {"relay": torch.tensor(choice)})
                want = executed_sources(p, fanout)
                g = to(p, "cuda")
                if choice is not None:
                    g.info = {"relay": torch.tensor(choice, device="cuda")}
                got = guard_cuda.executed_sources(g, fanout)
                assert all(torch.equal(x.cpu(), y) for x, y in zip(got, want)), (case, fanout, choice)
        assert torch.equal(relay_sources(plan, 2)[0], executed_sources(plan, 2)[0])


@gpu
def test_no_host_synchronisation_and_graph_replay():
    plans, _ = plans_of(3)
    g = [to(p, "cuda") for p in plans]
    guard = NetBenefitGuard(relay_fanout=2)
    allow = torch.tensor(True, device="cuda")

    def call():
        ex, fired, saved, cost = guard.select(g[0], 2e-7, 1, allow=allow, candidates=tuple(g[1:]))
        src, lvl = guard_cuda.executed_sources(ex, 2)
        return (ex.slot_expert, ex.route, ex.info["guard_choice"], ex.info["relay"], fired, saved, cost, src, lvl,
                ex.info["relay_trees"])

    eager = [t.clone() for t in call()]  # builds the extension on first use
    assert torch.equal(torch.stack(eager[7:9]), eager[9])  # the guard's own trees: the trees kernel's of its plan
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    # two graphs: one on the kept workspace, one whose workspace is made in the capture (not kept); each call leaves
    # its workspace zero for the next, eager calls between replays included
    graphs = []
    for fresh in (False, True):
        if fresh:
            guard_cuda._workspaces.clear()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = call()
        graphs.append((graph, captured))
    assert guard_cuda._workspaces == {}  # made in the capture: not kept
    for flip in (False, True, False, False):
        for graph, captured in graphs:
            allow.fill_(not flip)
            graph.replay()
            torch.cuda.synchronize()
            if not flip:
                assert all(torch.equal(x, y) for x, y in zip(captured, eager))
            else:  # allow False: the static plan, replayed from the same graph
                assert bool(captured[4]) and int((captured[0] >= 0).sum()) == 0
        allow.fill_(True)
        assert all(torch.equal(x, y) for x, y in zip(call(), eager))
