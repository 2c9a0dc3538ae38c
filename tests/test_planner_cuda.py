"""GPU tests (skipped without CUDA; run on the GPU machine): the CUDA planner returns the reference plan
bit for bit on thousands of random instances, never synchronises the host, and replays in a CUDA graph
with the same result as eager."""

import os

import pytest
import torch

import planner_cases as pc
from cuda_checks import captured, without_host_sync
from topoep import Topology, solve
from topoep.planners.cuda import CudaPlanner
from topoep.workloads import biased_routing

pytestmark = pytest.mark.gpu


def _check_against_reference(chunk) -> None:
    """Every policy's slot_expert and route (and the dense view of every tenth case) of a chunk's cases equal
    the reference's, compared by digest (tests/planner_cases.py)."""
    workers = max(1, min(8, (os.cpu_count() or 2) // 2))
    cases = pc.cases_of(chunk, workers)
    stored = pc.load_digests(chunk) or [None] * len(cases)
    refs = {i: s for i, s in enumerate(stored) if s is not None and s["omega"] == pc.digest(cases[i][0])}
    missing = [(i, case) for i, case in enumerate(cases) if i not in refs]
    if missing:  # the CPU reference is the slow side: compute what the digest file lacks in worker processes
        refs.update(zip((i for i, _ in missing), pc.reference_digests_parallel(missing, workers)))
    mismatches = []
    for i, (omega, topo, N, W) in enumerate(cases):
        for policy in pc.POLICIES:
            if refs[i][policy] == pc.REFUSED:  # beyond the policy's integer range: the reference refuses it
                continue
            got = solve(omega.cuda(), topo, num_slots=N, policy=policy, expert_bytes=W, token_bytes=pc.TOKEN_BYTES,
                        backend="cuda")
            if pc.plan_digests(got, pc.with_dense(i)) != refs[i][policy]:
                mismatches.append((i, policy, tuple(omega.shape), topo.num_domains, N, W))
    assert not mismatches, f"{len(mismatches)} plans differ from the reference, e.g. {mismatches[:5]}"


@pytest.mark.parametrize("chunk", range(pc.CHUNKS))
def test_cuda_plan_equals_reference(chunk):
    """2400 random cases over the chunks: R 8-128, E 40-1280, 0-4 slots, 1-16 domains, skews, zero rows."""
    _check_against_reference(chunk)


def test_cuda_plan_equals_reference_large_loads_and_many_slots():
    """Domain loads of 2^26 and more (the refinement's 64-bit path; the register path needs less) and 5-6
    slots (no unrolled slot loops). The largest loads are beyond topoep_plus's integer range (its costs compare
    bytes x femtoseconds): the reference refuses them, and they are not compared."""
    _check_against_reference("large")


def test_no_host_synchronisation():
    omega = biased_routing(32, 640, 512, 8, -2.5, seed=3).cuda()
    topo = Topology(num_domains=4, ranks_per_domain=8)
    solve(omega, topo, num_slots=2, backend="cuda")  # first call builds the planner and its buffers
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for policy in ("topoep", "static", "topoep_plus"):
            solve(omega, topo, num_slots=2, policy=policy, backend="cuda")
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("policy", ["topoep", "topoep_plus"])
def test_graph_replay_equals_eager(policy):
    R, E, N = 32, 640, 2
    topo = Topology(num_domains=4, ranks_per_domain=8)
    planner = CudaPlanner(R, E, topo.num_domains, N, "cuda")
    omega_buf = torch.zeros(R, E, dtype=torch.int64, device="cuda")
    se = torch.empty(R, N, dtype=torch.int64, device="cuda")
    rt = torch.empty(R, E + R * N, dtype=torch.int64, device="cuda")
    args = (topo, policy, 9_437_184, 4096, se, rt)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        planner.plan(omega_buf, *args)  # warm up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        planner.plan(omega_buf, *args)
    for seed, layout in [(1, "random"), (2, "clustered"), (3, "scattered"), (4, "random")]:
        omega = biased_routing(R, E, 1024, 8, -3.0, seed=seed, layout=layout).cuda()
        omega_buf.copy_(omega)
        graph.replay()
        replayed = (se.clone(), rt.clone())
        eager = solve(omega, topo, num_slots=N, policy=policy, backend="cuda")
        ref = solve(omega.cpu(), topo, num_slots=N, policy=policy, backend="reference")
        assert torch.equal(replayed[0], eager.slot_expert) and torch.equal(replayed[1], eager.route)
        assert torch.equal(replayed[0].cpu(), ref.slot_expert) and torch.equal(replayed[1].cpu(), ref.route)


@pytest.mark.parametrize("policy", ["topoep", "topoep_plus"])
def test_enable_flag_is_read_on_the_device(policy):
    """enable False: the kernel writes the static plan (and topoep_plus 0 moves); True: the policy's plan. One
    captured graph replays both values of the flag, and both grids (one block, many blocks) honour it."""
    R, E, N = 32, 640, 2
    topo = Topology(num_domains=4, ranks_per_domain=8)
    omega = biased_routing(R, E, 1024, 8, -3.0, seed=5, layout="clustered").cuda()
    static = solve(omega.cpu(), topo, num_slots=N, policy="static", backend="reference")
    ref = solve(omega.cpu(), topo, num_slots=N, policy=policy, backend="reference")
    assert not torch.equal(ref.route, static.route)
    planner = CudaPlanner(R, E, topo.num_domains, N, "cuda")
    flag = torch.ones((), dtype=torch.bool, device="cuda")
    se = torch.empty(R, N, dtype=torch.int64, device="cuda")
    rt = torch.empty(R, E + R * N, dtype=torch.int64, device="cuda")
    args = (topo, policy, 9_437_184, 4096, se, rt)
    for blocks in (1, 0):
        for on, want in ((False, static), (True, ref), (False, static)):
            flag.fill_(on)
            planner.plan(omega, *args, grid_blocks=blocks, enable=flag)
            assert torch.equal(se.cpu(), want.slot_expert) and torch.equal(rt.cpu(), want.route), (blocks, on)
            if policy == "topoep_plus" and not on:
                assert planner.moves() == 0
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        planner.plan(omega, *args, enable=flag)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        planner.plan(omega, *args, enable=flag)
    for on, want in ((True, ref), (False, static), (True, ref)):
        flag.fill_(on)
        graph.replay()
        assert torch.equal(se.cpu(), want.slot_expert) and torch.equal(rt.cpu(), want.route), on
    plan = solve(omega, topo, num_slots=N, policy=policy, enable=flag.fill_(False))
    assert plan.info.get("backend") == "cuda" and torch.equal(plan.route.cpu(), static.route)


def test_plan_concurrently_equals_one_by_one_and_replays():
    """topoep_plus and its local plan on two streams at once (each with its own workspace): the reference plans,
    eagerly and replayed from a CUDA graph."""
    from topoep.planners import plan_concurrently

    R, E, N = 32, 640, 2
    topo = Topology(num_domains=4, ranks_per_domain=8)
    names = ("topoep_plus", "topoep_plus_local")
    kw = dict(num_slots=N, expert_bytes=9_437_184, token_bytes=4096)
    omega_buf = torch.zeros(R, E, dtype=torch.int64, device="cuda")
    plan_concurrently(omega_buf, topo, names, kw)  # warm up: the planners and their workspaces
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = plan_concurrently(omega_buf, topo, names, kw)
    for seed, layout in [(1, "random"), (2, "clustered"), (3, "scattered")]:
        omega = biased_routing(R, E, 1024, 8, -3.0, seed=seed, layout=layout)
        refs = [solve(omega, topo, policy=p, backend="reference", **kw) for p in names]
        eager = plan_concurrently(omega.cuda(), topo, names, kw)
        omega_buf.copy_(omega)
        graph.replay()
        for ref, got, rep in zip(refs, eager, captured):
            assert got.policy == ref.policy
            assert torch.equal(got.route.cpu(), ref.route) and torch.equal(got.slot_expert.cpu(), ref.slot_expert)
            assert torch.equal(rep.route.cpu(), ref.route) and torch.equal(rep.slot_expert.cpu(), ref.slot_expert)


def test_auto_backend_uses_cuda_for_gpu_omega():
    omega = biased_routing(8, 64, 64, 2, -2.0, seed=1).cuda()
    plan = solve(omega, Topology(num_domains=2, ranks_per_domain=4), num_slots=1)
    assert plan.info.get("backend") == "cuda" and plan.route.is_cuda
    plan.check()


def test_phase_stamps_cover_the_plan():
    omega = biased_routing(16, 320, 256, 8, -2.0, seed=5).cuda()
    topo = Topology(num_domains=2, ranks_per_domain=8)
    planner = CudaPlanner(16, 320, 2, 2, "cuda")
    se = torch.empty(16, 2, dtype=torch.int64, device="cuda")
    rt = torch.empty(16, 320 + 32, dtype=torch.int64, device="cuda")
    planner.plan(omega, topo, "topoep", 9_437_184, 4096, se, rt)
    phases = planner.phase_ns()
    assert list(phases) == ["demand", "placement", "instances", "split", "refine", "route"]
    assert all(v >= 0 for v in phases.values()) and sum(phases.values()) > 0
    prof = planner.refine_profile(omega, topo, 9_437_184, 4096)  # a profiled plan: the counters are written
    assert prof["iterations"] >= 0 and prof["loop_cycles"] > 0
    planner.plan(omega, topo, "topoep", 9_437_184, 4096, se, rt)  # and the flag is off again
    ref = solve(omega.cpu(), topo, num_slots=2, backend="reference")
    assert torch.equal(se.cpu(), ref.slot_expert) and torch.equal(rt.cpu(), ref.route)


def test_skip_stages_time_a_valid_plan_and_stay_in_their_call():
    """The latency variants (skip_stages) still route every token, the next plan without them is the policy's,
    and the op refuses a mask beyond the known bits and the wrapper a negative grid."""
    R, E, N = 16, 320, 2
    topo = Topology(num_domains=2, ranks_per_domain=8)
    omega = biased_routing(R, E, 512, 8, -3.0, seed=9).cuda()
    planner = CudaPlanner(R, E, topo.num_domains, N, "cuda")
    se = torch.empty(R, N, dtype=torch.int64, device="cuda")
    rt = torch.empty(R, E + R * N, dtype=torch.int64, device="cuda")
    planner.plan(omega, topo, "topoep", 9_437_184, 4096, se, rt, skip_stages=1)  # no refinement: stage 1/2, routed
    assert torch.equal(rt.sum(1), omega.sum(1))  # every source's tokens are routed
    inst_expert = torch.cat([torch.arange(E, device="cuda"), se.flatten()])
    per_expert = torch.zeros(R, E, dtype=torch.int64, device="cuda")
    live = inst_expert >= 0
    per_expert.index_add_(1, inst_expert[live], rt[:, live])
    assert torch.equal(per_expert, omega)  # to instances of the right expert
    planner.plan(omega, topo, "topoep", 9_437_184, 4096, se, rt)
    ref = solve(omega.cpu(), topo, num_slots=N, backend="reference")
    assert torch.equal(se.cpu(), ref.slot_expert) and torch.equal(rt.cpu(), ref.route)
    with pytest.raises(ValueError, match="skip_stages must be a combination"):
        planner.plan(omega, topo, "topoep", 9_437_184, 4096, se, rt, skip_stages=256)
    with pytest.raises(ValueError, match="grid_blocks must be an integer >= 0"):
        planner.plan(omega, topo, "topoep", 9_437_184, 4096, se, rt, grid_blocks=-1)


def test_solve_takes_the_grid_per_call():
    """solve's grid_blocks reaches the CUDA planner for its call alone: every grid gives the reference's plan,
    before and after a plan on another grid."""
    R, E, N = 32, 640, 2
    topo = Topology(num_domains=4, ranks_per_domain=8)
    omega = biased_routing(R, E, 1024, 8, -3.0, seed=21)
    for policy in ("topoep", "topoep_plus"):
        ref = solve(omega, topo, num_slots=N, policy=policy, backend="reference")
        for blocks in (0, 3, 0, 132, 1):
            got = solve(omega.cuda(), topo, num_slots=N, policy=policy, backend="cuda", grid_blocks=blocks)
            assert torch.equal(got.slot_expert.cpu(), ref.slot_expert), (policy, blocks)
            assert torch.equal(got.route.cpu(), ref.route), (policy, blocks)


def test_topoep_plus_moves_and_its_two_level_rule():
    """The Fig. 10 workload with 1 slot makes free moves (3 when written): the GPU counts the same as the
    reference and returns its plan; a cost matrix that is not two-level is refused by backend cuda and planned
    by the reference under backend auto."""
    from topoep.workloads import fig10_workload

    topo = Topology(num_domains=4, ranks_per_domain=8)
    omega = fig10_workload(layout="random")
    ref = solve(omega, topo, num_slots=1, policy="topoep_plus", backend="reference")
    planner = CudaPlanner(32, 640, 4, 1, "cuda")
    se = torch.empty(32, 1, dtype=torch.int64, device="cuda")
    rt = torch.empty(32, 640 + 32, dtype=torch.int64, device="cuda")
    planner.plan(omega.cuda(), topo, "topoep_plus", ref.expert_bytes, ref.token_bytes, se, rt)
    assert ref.info["global_moves"] > 0 and planner.moves() == ref.info["global_moves"]
    assert torch.equal(se.cpu(), ref.slot_expert) and torch.equal(rt.cpu(), ref.route)
    cost = topo.cost.clone()
    cost[0, 1] = cost[1, 0] = cost[0, 1] * 2
    odd = Topology(num_domains=4, ranks_per_domain=8, cost=cost)
    with pytest.raises(ValueError, match="two-level"):
        solve(omega.cuda(), odd, num_slots=1, policy="topoep_plus", backend="cuda")
    auto = solve(omega.cuda(), odd, num_slots=1, policy="topoep_plus")
    assert auto.info.get("backend") != "cuda"
    want = solve(omega, odd, num_slots=1, policy="topoep_plus", backend="reference")
    assert torch.equal(auto.route.cpu(), want.route)


# (R, E, domains, slots, router skew, layout): domains of 6, 12 and 24 ranks (a lane group wider than the domain
# in the route's pass A), 48 (more than a warp: a thread per group), and one domain of 40 ranks
ODD_DOMAIN_CASES = [(24, 96, 4, 2, -3.0, "random"), (24, 240, 2, 4, -4.0, "clustered"), (48, 96, 2, 1, -2.0, "random"),
                    (96, 192, 2, 3, -4.0, "scattered"), (96, 384, 4, 2, -3.0, "clustered"), (40, 320, 1, 2, -4.0, "random"),
                    (72, 144, 6, 2, -8.0, "random")]


@pytest.mark.parametrize("case", ODD_DOMAIN_CASES, ids=lambda c: f"R{c[0]}-E{c[1]}-M{c[2]}-N{c[3]}")
def test_plans_for_any_domain_size_grid_and_move_path(case):
    """Domains whose size is not a power of two (the random cases have only powers of two), each planned with
    the default grid, with 3 and 132 blocks (grid_blocks), and for topoep_plus with its moves on the global
    loads (kPlusGlobal = 16, the path of plans too large for a copy per block) and with its route's pass A forced
    to a thread (32) or a lane group (64) per group, and the one-domain case on a grid instead of its one block
    (kNoLocal = 128): every plan equals the reference's."""
    _check_paths(case, case[0] + case[1] + case[3], ("topoep", "topoep_plus"),
                 [(0, 0), (3, 0), (132, 0), (0, 16), (3, 16), (0, 32), (0, 64), (3, 64), (0, 128), (5, 144)])


def _check_paths(case, seed: int, policies, paths) -> None:
    """Every (grid_blocks, skip_stages) of `paths` plans `case`'s routing (R, E, domains, slots, skew, layout; seeded
    with `seed`) as the reference does, for every policy."""
    R, E, M, N, skew, layout = case
    topo = Topology(num_domains=M, ranks_per_domain=R // M)
    omega = biased_routing(R, E, 512, 8, skew, seed=seed, layout=layout)
    planner = CudaPlanner(R, E, M, N, "cuda")
    se = torch.empty(R, N, dtype=torch.int64, device="cuda")
    rt = torch.empty(R, E + R * N, dtype=torch.int64, device="cuda")
    for policy in policies:
        ref = solve(omega, topo, num_slots=N, policy=policy, expert_bytes=9_437_184, token_bytes=4096,
                    backend="reference")
        for blocks, mask in paths:
            planner.plan(omega.cuda(), topo, policy, 9_437_184, 4096, se, rt, grid_blocks=blocks, skip_stages=mask)
            assert torch.equal(se.cpu(), ref.slot_expert) and torch.equal(rt.cpu(), ref.route), (policy, blocks, mask)


# (R, E, domains, slots, router skew, layout): domains of 1-8 ranks, whose route pass A with a thread per group keeps
# the sources in registers (route_groups_regs), at EP 128 the default path
REG_SOURCE_CASES = [(16, 64, 4, 2, -6.0, "clustered"), (16, 128, 8, 1, -3.0, "clustered"), (24, 96, 8, 3, -4.0, "random"),
                    (40, 160, 8, 4, -3.0, "scattered"), (56, 224, 8, 2, -8.0, "clustered"), (64, 640, 8, 2, -2.5, "random"),
                    (128, 640, 16, 2, -2.5, "random"), (128, 256, 32, 2, -4.0, "clustered")]


@pytest.mark.parametrize("case", REG_SOURCE_CASES, ids=lambda c: f"R{c[0]}-E{c[1]}-M{c[2]}-N{c[3]}")
def test_route_pass_a_in_registers_equals_reference(case):
    """topoep_plus's route pass A with a thread per group on domains of 1-8 ranks (the register path, forced by
    kRouteSerial = 32, and the default choice, which takes it at EP 128), on the default grid and on 3 blocks, with
    its moves on per-block and global loads: every plan equals the reference's."""
    _check_paths(case, case[0] + case[1] + case[2], ("topoep_plus",), [(0, 32), (3, 32), (0, 48), (0, 0)])


_ERRORS_SCRIPT = r'''
import torch
from topoep.planners.cuda import load_extension

load_extension()
ops, dev = torch.ops.topoep, "cuda"
om = torch.ones(4, 8, dtype=torch.int64, device=dev)
cost = torch.zeros(4, 4, dtype=torch.int64, device=dev)
se = torch.empty(4, 2, dtype=torch.int64, device=dev)
rt = torch.empty(4, 16, dtype=torch.int64, device=dev)
info = torch.zeros(64, dtype=torch.int64, device=dev)
ws = torch.zeros(16, dtype=torch.int64, device=dev)
cases = [
    ("skip_stages", lambda: ops.plan_topoep(om, cost, 1, 2, 1, 1, se, rt, ws, 0, 999), "got 999"),
    ("cost_fs on the host", lambda: ops.plan_topoep(om, cost.cpu(), 1, 2, 1, 1, se, rt, ws), "cost_fs must be a CUDA"),
    ("workspace", lambda: ops.plan_topoep(om, cost, 1, 2, 1, 1, se, rt, ws), "workspace too small"),
    ("peer policy", lambda: ops.plan_peer(om, 7, 1, 2, None, se, rt, info, ws, 0), "(flexmoe), got 7"),
    ("spread slots", lambda: ops.plan_spread(om, 1, 65, 1, 1, 0, 0, 0, 0, 0, False, None, se, rt, info, ws),
     "num_slots must be in [0, 64], got 65"),
    ("spread move cost", lambda: ops.plan_spread(om, 1, 2, 1, 1, 0, 0, 0, 0, -1, False, None, se, rt, info, ws),
     "move_cost_fs must be >= 0"),
]
for name, call, want in cases:
    try:
        call()
        print("NO ERROR", name)
    except RuntimeError as e:
        print("RAISED" if want in str(e) else "OTHER MESSAGE", name, "|", str(e).splitlines()[0][:200])
'''


def test_extension_checks_raise_their_messages():
    """A failed check inside the extension's ops raises a RuntimeError that names the value, whether its message has
    values (TOPOEP_CHECK, formatted in csrc/bindings.cpp) or is one string; in a subprocess, so a crash fails the test
    instead of the session."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _ERRORS_SCRIPT], capture_output=True, text=True, timeout=600)
    lines = [line for line in out.stdout.splitlines() if line.split(" ")[0] in ("RAISED", "NO", "OTHER")]
    assert out.returncode == 0, f"the process ended with {out.returncode}: {out.stdout[-2000:]} {out.stderr[-2000:]}"
    assert len(lines) == 6 and all(line.startswith("RAISED") for line in lines), "\n".join(lines)


@pytest.mark.parametrize("domains,rpd,plan_domain", [(1, 64, 8), (1, 32, 16), (2, 16, 4)])
def test_plan_domain_on_the_gpu_equals_reference_without_host_sync(domains, rpd, plan_domain):
    """`solve(..., plan_domain=...)` (LayerConfig.plan_domain): the CUDA planner on the groups returns the reference's
    plan bit for bit, on the real topology, without host synchronisation, and replays in a CUDA graph alike."""
    R, E, N = domains * rpd, 640, 2
    topo = Topology(num_domains=domains, ranks_per_domain=rpd)
    omega = biased_routing(R, E, 1024, 8, -2.5, seed=13).cuda()
    policies = ("topoep", "topoep_plus", "topoep_plus_local")
    for policy in policies:
        got = solve(omega, topo, num_slots=N, policy=policy, plan_domain=plan_domain)  # auto: the CUDA planner
        ref = solve(omega.cpu(), topo, num_slots=N, policy=policy, backend="reference", plan_domain=plan_domain)
        assert got.info["backend"] == "cuda" and got.topology is topo and got.info["plan_domain"] == plan_domain
        assert torch.equal(got.slot_expert.cpu(), ref.slot_expert) and torch.equal(got.route.cpu(), ref.route), policy
    without_host_sync(lambda: [solve(omega, topo, num_slots=N, policy=p, plan_domain=plan_domain) for p in policies])
    buf = omega.clone()
    graph, captured_plan = captured(lambda: solve(buf, topo, num_slots=N, policy="topoep_plus", plan_domain=plan_domain))
    other = biased_routing(R, E, 1024, 8, -3.0, seed=4, layout="clustered").cuda()
    buf.copy_(other)
    graph.replay()
    ref = solve(other.cpu(), topo, num_slots=N, policy="topoep_plus", backend="reference", plan_domain=plan_domain)
    assert torch.equal(captured_plan.slot_expert.cpu(), ref.slot_expert)
    assert torch.equal(captured_plan.route.cpu(), ref.route)
