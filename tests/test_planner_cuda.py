"""GPU tests (skipped without CUDA; run on the GPU machine): the CUDA planner returns the reference plan
bit for bit on thousands of random instances, never synchronises the host, and replays in a CUDA graph
with the same result as eager."""

import random

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


@pytest.mark.parametrize("chunk", range(4))
def test_cuda_plan_equals_reference(chunk):
    rng = random.Random(1000 + chunk)
    mismatches = []
    for i in range(600):  # 2400 cases over the 4 chunks
        omega, topo, N, W = random_case(rng)
        for policy in ("topoep", "static"):
            ref = solve(omega, topo, num_slots=N, policy=policy, expert_bytes=W, token_bytes=4096, backend="reference")
            got = solve(omega.cuda(), topo, num_slots=N, policy=policy, expert_bytes=W, token_bytes=4096,
                        backend="cuda")
            same = torch.equal(got.slot_expert.cpu(), ref.slot_expert) and torch.equal(got.route.cpu(), ref.route)
            if not same:
                mismatches.append((i, policy, tuple(omega.shape), topo.num_domains, N, W))
            else:
                x1, q1 = got.to_dense()
                x0, q0 = ref.to_dense()
                assert torch.equal(x1.cpu(), x0) and torch.equal(q1.cpu(), q0)
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
