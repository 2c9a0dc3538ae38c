"""GPU tests (skipped without CUDA; run on the GPU machine): the CUDA planner returns the reference plan
bit for bit on thousands of random instances, never synchronises the host, and replays in a CUDA graph
with the same result as eager."""

import multiprocessing
import os
import random
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from topoep import Topology, solve
from topoep.planners.cuda import CudaPlanner
from topoep.workloads import biased_routing

pytestmark = pytest.mark.gpu

W_CHOICES = (200_000, 9_437_184, 4096)


def random_case(rng: random.Random):
    R = rng.choice([8, 16, 32, 64, 128])
    ks = [k for k in range(1, 1281) if 40 <= R * k <= 1280]
    E = R * rng.choice(ks)
    M = rng.choice([m for m in (1, 2, 4, 8, 16) if R % m == 0])
    N = rng.randint(0, 4)
    omega = biased_routing(R, E, rng.choice([0, 16, 128, 512]), rng.randint(1, 8), rng.choice([0.0, -1.0, -2.0, -4.0, -8.0]),
                           seed=rng.randrange(1 << 30), layout=rng.choice(["random", "clustered", "scattered"]))
    for s in rng.sample(range(R), rng.randint(0, R // 4)):
        omega[s] = 0
    return omega, Topology(num_domains=M, ranks_per_domain=R // M), N, rng.choice(W_CHOICES)


def _reference_plans(cases):
    """Reference plans of a batch of cases (runs in a worker process)."""
    torch.set_num_threads(1)
    out = []
    for omega, topo, N, W in cases:
        for policy in ("topoep", "static"):
            ref = solve(omega, topo, num_slots=N, policy=policy, expert_bytes=W, token_bytes=4096, backend="reference")
            out.append((ref.slot_expert, ref.route))
    return out


@pytest.mark.parametrize("chunk", range(4))
def test_cuda_plan_equals_reference(chunk):
    rng = random.Random(1000 + chunk)
    cases = [random_case(rng) for _ in range(600)]  # 2400 cases over the 4 chunks
    # the CPU reference is the slow side: compute it in worker processes
    workers = max(1, min(8, (os.cpu_count() or 2) // 2))
    batches = [cases[i::workers] for i in range(workers)]
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        results = list(pool.map(_reference_plans, batches))
    refs = [None] * (2 * len(cases))
    for w, res in enumerate(results):
        for j, plan in enumerate(res):
            refs[2 * (w + workers * (j // 2)) + j % 2] = plan
    mismatches = []
    for i, (omega, topo, N, W) in enumerate(cases):
        for k, policy in enumerate(("topoep", "static")):
            ref_se, ref_route = refs[2 * i + k]
            got = solve(omega.cuda(), topo, num_slots=N, policy=policy, expert_bytes=W, token_bytes=4096,
                        backend="cuda")
            same = torch.equal(got.slot_expert.cpu(), ref_se) and torch.equal(got.route.cpu(), ref_route)
            if not same:
                mismatches.append((i, policy, tuple(omega.shape), topo.num_domains, N, W))
            elif i % 10 == 0:  # the dense view of a sample (to_dense is slow)
                ref = solve(omega, topo, num_slots=N, policy=policy, expert_bytes=W, token_bytes=4096,
                            backend="reference")
                x1, q1 = got.to_dense()
                x0, q0 = ref.to_dense()
                assert torch.equal(x1.cpu(), x0) and torch.equal(q1.cpu(), q0)
    assert not mismatches, f"{len(mismatches)} plans differ from the reference, e.g. {mismatches[:5]}"


def test_cuda_plan_equals_reference_large_loads_and_many_slots():
    """Domain loads of 2^26 and more (the refinement's 64-bit path; the register path needs less) and 5-6
    slots (no unrolled slot loops)."""
    rng = random.Random(77)
    mismatches = []
    for i in range(80):
        omega, topo, N, W = random_case(rng)
        if i % 2 == 0:
            omega = omega * rng.choice([1 << 11, 1 << 22, (1 << 28) + 3])  # domain totals past 2^26 (and 2^31)
        else:
            N = rng.choice([5, 6])
        ref = solve(omega, topo, num_slots=N, expert_bytes=W, token_bytes=4096, backend="reference")
        got = solve(omega.cuda(), topo, num_slots=N, expert_bytes=W, token_bytes=4096, backend="cuda")
        if not (torch.equal(got.slot_expert.cpu(), ref.slot_expert) and torch.equal(got.route.cpu(), ref.route)):
            mismatches.append((i, tuple(omega.shape), topo.num_domains, N, W))
    assert not mismatches, f"{len(mismatches)} plans differ from the reference, e.g. {mismatches[:5]}"


def test_no_host_synchronisation():
    omega = biased_routing(32, 640, 512, 8, -2.5, seed=3).cuda()
    topo = Topology(num_domains=4, ranks_per_domain=8)
    solve(omega, topo, num_slots=2, backend="cuda")  # first call builds the planner and its buffers
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for policy in ("topoep", "static"):
            solve(omega, topo, num_slots=2, policy=policy, backend="cuda")
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_graph_replay_equals_eager():
    R, E, N = 32, 640, 2
    topo = Topology(num_domains=4, ranks_per_domain=8)
    planner = CudaPlanner(R, E, topo.num_domains, N, "cuda")
    omega_buf = torch.zeros(R, E, dtype=torch.int64, device="cuda")
    se = torch.empty(R, N, dtype=torch.int64, device="cuda")
    rt = torch.empty(R, E + R * N, dtype=torch.int64, device="cuda")
    args = (topo, "topoep", 9_437_184, 4096, se, rt)
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
        eager = solve(omega, topo, num_slots=N, backend="cuda")
        ref = solve(omega.cpu(), topo, num_slots=N, backend="reference")
        assert torch.equal(replayed[0], eager.slot_expert) and torch.equal(replayed[1], eager.route)
        assert torch.equal(replayed[0].cpu(), ref.slot_expert) and torch.equal(replayed[1].cpu(), ref.route)


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


def test_skip_stages_time_a_valid_plan_and_reset():
    """The latency variants (set_skip_stages) still route every token, and mask 0 gives the policy back."""
    R, E, N = 16, 320, 2
    topo = Topology(num_domains=2, ranks_per_domain=8)
    omega = biased_routing(R, E, 512, 8, -3.0, seed=9).cuda()
    planner = CudaPlanner(R, E, topo.num_domains, N, "cuda")
    se = torch.empty(R, N, dtype=torch.int64, device="cuda")
    rt = torch.empty(R, E + R * N, dtype=torch.int64, device="cuda")
    try:
        torch.ops.topoep.set_skip_stages(1)  # no refinement: the stage-1/2 plan, routed
        planner.plan(omega, topo, "topoep", 9_437_184, 4096, se, rt)
    finally:
        torch.ops.topoep.set_skip_stages(0)
    assert torch.equal(rt.sum(1), omega.sum(1))  # every source's tokens are routed
    inst_expert = torch.cat([torch.arange(E, device="cuda"), se.flatten()])
    per_expert = torch.zeros(R, E, dtype=torch.int64, device="cuda")
    live = inst_expert >= 0
    per_expert.index_add_(1, inst_expert[live], rt[:, live])
    assert torch.equal(per_expert, omega)  # to instances of the right expert
    planner.plan(omega, topo, "topoep", 9_437_184, 4096, se, rt)
    ref = solve(omega.cpu(), topo, num_slots=N, backend="reference")
    assert torch.equal(se.cpu(), ref.slot_expert) and torch.equal(rt.cpu(), ref.route)
