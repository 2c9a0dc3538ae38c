"""Multi-rank tests (CPU, gloo, several processes): ExpertParallelMoE against a single-process dense
reference for every policy, payload routing, replica use under skew, the two-chunk pipeline, that the
replica pool is allocated once and memory does not grow, and that the benchmarks' phase timer changes no
value. Virtual topologies: 4 ranks = 2 domains x 2, 8 ranks = 2 domains x 4.
"""

import gc

import pytest
import torch
import torch.nn.functional as F

from distributed import rank_device, run_ranks
from topoep import OFFLINE_POLICIES, POLICIES, ExpertParallelMoE, ReplicaPool, Topology, solve
from topoep.runtime.backend import TorchBackend
from topoep.runtime.layout import assignment_instances, chunk_layouts, local_group


def make_inputs(R, E, T, k, H, Fd, skew, seed, dtype=torch.float32):
    """Every rank builds the same global inputs; rank r uses x[r], idx[r], w[r]."""
    g = torch.Generator().manual_seed(seed)
    bias = torch.randn(E, generator=g) * skew
    logits = torch.randn(R, T, E, generator=g) + bias
    idx = torch.topk(logits, k, dim=-1).indices
    w = torch.softmax(torch.randn(R, T, k, generator=g), -1)
    x = torch.randn(R, T, H, generator=g)
    fc1 = torch.randn(E, 2 * Fd, H, generator=g) * 0.2
    fc2 = torch.randn(E, H, Fd, generator=g) * 0.2
    gy = torch.randn(R, T, H, generator=g)
    return [t.to(dtype) if t.is_floating_point() else t for t in (x, idx, w, fc1, fc2, gy)]


def dense_reference(x, idx, w, fc1, fc2, gy):
    """All experts on one process: y[r, t] = sum_j w[r,t,j] * FFN_{idx[r,t,j]}(x[r,t]); grads of loss = <y, gy>."""
    x, w, fc1, fc2 = (t.detach().clone().double().requires_grad_() for t in (x, w, fc1, fc2))
    Fd = fc2.shape[2]
    h = torch.einsum("rth,efh->rtef", x, fc1)  # all experts for every token (small sizes)
    act = F.silu(h[..., :Fd]) * h[..., Fd:]
    out = torch.einsum("rtef,ehf->rteh", act, fc2)
    sel = torch.gather(out, 2, idx[..., None].expand(*idx.shape, out.shape[-1]))  # [R, T, k, H]
    y = (sel * w[..., None]).sum(2)
    (y * gy.double()).sum().backward()
    return y.detach(), x.grad, w.grad, fc1.grad, fc2.grad


def _layer_vs_reference(rank, world, rpd, policies, chunks_list, skew, device="cpu", N=2, guard=False):
    """guard=False: at these tiny sizes the net-benefit guard would rightly skip replication, and these
    tests are about the balanced path (the guard has its own tests)."""
    E_loc, T, k, H, Fd = 4, 24, 2, 8, 6
    R, E = world, world * E_loc
    dev = rank_device(rank) if device == "cuda" else torch.device("cpu")
    topo = Topology(num_domains=world // rpd, ranks_per_domain=rpd)
    x, idx, w, fc1, fc2, gy = make_inputs(R, E, T, k, H, Fd, skew, seed=7)
    ref_y, ref_gx, ref_gw, ref_g1, ref_g2 = dense_reference(x, idx, w, fc1, fc2, gy)
    x, idx, w, fc1, fc2, gy = (t.to(dev) for t in (x, idx, w, fc1, fc2, gy))
    lo, hi = rank * E_loc, (rank + 1) * E_loc
    out = {}
    for policy in policies:
        for chunks in chunks_list:
            layer = ExpertParallelMoE(num_experts=E, hidden_size=H, ffn_hidden_size=Fd, topology=topo, num_slots=N,
                                      policy=policy, num_chunks=chunks, device=dev, guard=guard)
            with torch.no_grad():
                layer.fc1.copy_(fc1[lo:hi])
                layer.fc2.copy_(fc2[lo:hi])
            xr = x[rank].clone().requires_grad_()
            wr = w[rank].clone().requires_grad_()
            y = layer(xr, idx[rank], wr)
            (y * gy[rank]).sum().backward()
            tol = dict(rtol=1e-4, atol=1e-5) if device == "cpu" else dict(rtol=2e-3, atol=2e-4)  # TF32 on GPU
            torch.testing.assert_close(y.double().cpu(), ref_y[rank], **tol)
            torch.testing.assert_close(xr.grad.double().cpu(), ref_gx[rank], **tol)
            torch.testing.assert_close(wr.grad.double().cpu(), ref_gw[rank], **tol)
            torch.testing.assert_close(layer.fc1.grad.double().cpu(), ref_g1[lo:hi], **tol)
            torch.testing.assert_close(layer.fc2.grad.double().cpu(), ref_g2[lo:hi], **tol)
            layer.last_plan.check()
            s = layer.stats_dict()
            out[(policy, chunks)] = dict(replica_fraction=s["replica_fraction"], imbalance=s["imbalance"],
                                         static_imbalance=s["static_imbalance"], y=y.detach().cpu(),
                                         capacity_moves=s["capacity_moves"])
    return out


@pytest.mark.parametrize("world,rpd", [(4, 2), (8, 4)])
def test_every_policy_matches_dense_reference(world, rpd):
    results = run_ranks(_layer_vs_reference, world, rpd, list(POLICIES), [2], 2.0)
    for policy in POLICIES:
        rep = [r[(policy, 2)]["replica_fraction"] for r in results]
        assert len(set(rep)) == 1  # every rank computed the same plan
        if policy == "static":  # replicas only where the capacity step placed them
            assert (rep[0] == 0.0) == (results[0][(policy, 2)]["capacity_moves"] == 0)
        elif policy in ("topoep", "flexmoe", "deepseek"):
            assert rep[0] > 0.0, f"{policy}: replicas not exercised under skew"
        assert results[0][(policy, 2)]["imbalance"] <= results[0][(policy, 2)]["static_imbalance"] + 1e-9 \
            or policy == "fastermoe"  # fastermoe trades balance for traffic by its own model


def test_layer_without_replica_slots():
    for r in run_ranks(_layer_vs_reference, 4, 2, ["static", "topoep"], [2], 2.0, "cpu", 0):
        assert r[("topoep", 2)]["replica_fraction"] == 0.0


def test_two_chunk_pipeline_equals_one_chunk():
    results = run_ranks(_layer_vs_reference, 4, 2, ["topoep"], [1, 2, 3], 3.0)
    for r in results:
        torch.testing.assert_close(r[("topoep", 1)]["y"], r[("topoep", 2)]["y"], rtol=0, atol=1e-6)
        torch.testing.assert_close(r[("topoep", 1)]["y"], r[("topoep", 3)]["y"], rtol=0, atol=1e-6)


def _payload(rank, world, rpd, E, T, k, N, skew):
    """Route int64 payload rows (source, token, choice, expert) and check every arrival."""
    topo = Topology(num_domains=world // rpd, ranks_per_domain=rpd)
    g = torch.Generator().manual_seed(100 + rank)
    bias = torch.randn(E, generator=torch.Generator().manual_seed(5)) * skew
    idx = torch.topk(torch.randn(T, E, generator=g) + bias, k, dim=-1).indices
    be = TorchBackend()
    omega = be.all_gather_counts(torch.bincount(idx.reshape(-1), minlength=E))
    plan = solve(omega, topo, num_slots=N, policy="topoep", expert_bytes=1000, token_bytes=64)
    inst = assignment_instances(idx, plan, rank)
    E_loc, G = E // world, E // world + N
    chunks = chunk_layouts(plan.instance_rank[inst], local_group(inst, plan), T, k, world, G, 2)
    a = torch.arange(T * k)
    payload = torch.stack([torch.full_like(a, rank), a // k, a % k, idx.reshape(-1)], 1)  # int64 rows
    seen = torch.zeros(world, plan.num_instances, dtype=torch.int64)
    for ch in chunks:
        ch.set_received(be.exchange_counts(ch.send_group_counts))
        rows = be.dispatch(payload[ch.send_idx], ch.send_counts, ch.recv_counts).wait()
        grouped = rows[ch.group_order]
        start = 0
        for grp, size in enumerate(ch.group_sizes.tolist()):
            part = grouped[start:start + size]
            start += size
            if grp < E_loc:
                p, expert = rank * E_loc + grp, rank * E_loc + grp
            else:
                p, expert = E + rank * N + (grp - E_loc), plan.slot_expert[rank, grp - E_loc].item()
            assert (part[:, 3] == expert).all(), f"rank {rank} group {grp}: rows for experts {part[:, 3].unique()}"
            seen[:, p] += torch.bincount(part[:, 0], minlength=world)
        back = be.combine(rows, ch.recv_counts, ch.send_counts).wait()
        assert torch.equal(back, payload[ch.send_idx]), "combine did not return rows to their origin"
    # every instance on this rank received exactly what the plan routes to it
    mine = plan.instance_rank == rank
    assert torch.equal(seen[:, mine], plan.route[:, mine])
    return plan.num_instances, int((plan.slot_expert >= 0).sum())


@pytest.mark.parametrize("E,N", [(320, 2), (2048, 3)])  # > 256 and > 2048 physical instances
def test_payload_rows_reach_the_planned_instance(E, N):
    res = run_ranks(_payload, 4, 2, E, 192, 8, N, 3.0)
    num_instances, num_replicas = res[0]
    assert num_instances > (2048 if E == 2048 else 256)
    assert num_replicas > 0


def _bf16_many_instances(rank, world):
    topo = Topology(num_domains=2, ranks_per_domain=2)
    E, H, Fd, T, k = 2048, 8, 4, 96, 8
    x, idx, w, fc1, fc2, _ = make_inputs(world, E, T, k, H, Fd, 3.0, seed=11)
    ys = {}
    for policy in ("static", "topoep"):
        layer = ExpertParallelMoE(num_experts=E, hidden_size=H, ffn_hidden_size=Fd, topology=topo, num_slots=3,
                                  policy=policy, dtype=torch.bfloat16, guard=False)  # the balanced path
        with torch.no_grad():
            layer.fc1.copy_(fc1[rank * 512:(rank + 1) * 512])
            layer.fc2.copy_(fc2[rank * 512:(rank + 1) * 512])
        ys[policy] = layer(x[rank].bfloat16(), idx[rank], w[rank].bfloat16()).float().detach()
        assert layer.last_plan.num_instances > 2048
    return ys["static"], ys["topoep"], layer.stats_dict()["replica_fraction"]


def test_bf16_layer_with_more_than_2048_instances_matches_static():
    for y_static, y_topo, rep in run_ranks(_bf16_many_instances, 4):
        assert rep > 0
        # same routing, same weights: only bf16 rounding differs (a misroute would be O(1))
        torch.testing.assert_close(y_topo, y_static, rtol=2e-2, atol=2e-2)


def _steps(rank, world, steps):
    # a forked rank inherits the parent's pools and counter (other tests build layers there): start fresh
    ReplicaPool._shared.clear()
    before = ReplicaPool.allocations
    topo = Topology(num_domains=2, ranks_per_domain=1)
    E, H, Fd, T, k = 8, 16, 8, 64, 2
    layers = [ExpertParallelMoE(num_experts=E, hidden_size=H, ffn_hidden_size=Fd, topology=topo, num_slots=2,
                                policy="topoep") for _ in range(2)]
    assert layers[0].pool is layers[1].pool
    ptr = layers[0].pool.fc1.data_ptr()
    # the inputs repeat with period 8, so the two counted steps (15 and the last, 47) see the same routing and
    # plans: the live tensors a plan holds depend on its replicas, and caches fill in the first period
    counts = []
    for step in range(steps):
        x, idx, w, *_ = make_inputs(world, E, T, k, H, Fd, 2.0, seed=step % 8)
        h = x[rank].requires_grad_()
        for layer in layers:
            h = h + layer(h, idx[rank], w[rank])
        h.sum().backward()
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        if step in (15, steps - 1):
            gc.collect()
            counts.append(sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor)))
    return ReplicaPool.allocations - before, layers[0].pool.fc1.data_ptr() == ptr, counts


def test_pool_allocated_once_and_memory_does_not_grow():
    for allocations, same_ptr, (live_at_15, live_at_end) in run_ranks(_steps, 2, 48):
        assert allocations == 1 and same_ptr
        assert live_at_end == live_at_15, f"live tensors went from {live_at_15} to {live_at_end} over 32 steps"


def _cast(rank, world):
    """Two layers built in fp32 and cast to bf16 after construction (as megatron's Float16Module does), then called."""
    ReplicaPool._shared.clear()
    topo = Topology(num_domains=2, ranks_per_domain=1)
    E, H, Fd, T, k = 8, 16, 8, 32, 2
    layers = [ExpertParallelMoE(num_experts=E, hidden_size=H, ffn_hidden_size=Fd, topology=topo, num_slots=2,
                                policy="topoep", guard=False).to(torch.bfloat16) for _ in range(2)]
    x, idx, w, *_ = make_inputs(world, E, T, k, H, Fd, 4.0, seed=3)
    before = ReplicaPool.allocations
    for layer in layers:
        layer(x[rank].to(torch.bfloat16), idx[rank], w[rank].to(torch.bfloat16)).sum().backward()
    gc.collect()
    allocated, dtypes = ReplicaPool.allocations - before, [key[3] for key in ReplicaPool._shared.keys()]
    bad = None
    try:
        ExpertParallelMoE(num_experts=E, hidden_size=H, ffn_hidden_size=Fd, topology=topo, num_slots=2,
                          pool=ReplicaPool(1, H, Fd))
    except ValueError as err:
        bad = str(err)
    return allocated, layers[0].pool is layers[1].pool, layers[0].pool.fc1.dtype, dtypes, layers[0].expert_bytes, bad


def test_a_layer_cast_after_construction_moves_to_one_pool_and_frees_the_old():
    """The first call after a cast swaps every layer to one pool of the new dtype (priced at its bytes), and the
    fp32 pool no layer holds any more is freed; a pool that does not fit the layer is refused."""
    for allocations, same, dtype, dtypes, expert_bytes, bad in run_ranks(_cast, 2):
        assert allocations == 1 and same and dtype == torch.bfloat16 and dtypes == [torch.bfloat16]
        assert expert_bytes == 3 * 16 * 8 * 2
        assert bad is not None and "pool has 1 slots" in bad and "needs 2 of [16, 16]" in bad


def test_single_process_layer_and_bad_input():
    topo = Topology(num_domains=1, ranks_per_domain=1)
    layer = ExpertParallelMoE(num_experts=4, hidden_size=8, ffn_hidden_size=4, topology=topo, num_slots=1)
    x = torch.randn(5, 8)
    idx = torch.tensor([[0, 1], [2, 3], [1, 1], [3, 0], [2, 2]])
    w = torch.rand(5, 2)
    y = layer(x, idx, w)
    assert y.shape == (5, 8)
    cases = [
        ((x, idx.clamp(max=3) + 1, w), "out of range"),
        ((x, idx.int(), w), "int64"),
        ((x, idx[:4], w[:4]), "T must match"),
        ((x, idx, w[:, :1]), "same k"),
        ((x[:, :7], idx, w), "hidden_size"),
        ((x, idx, (w > 0.5).long()), "floating point"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            layer(*args)
    with pytest.raises(ValueError, match="multiple of the EP size"):
        ExpertParallelMoE(num_experts=3, hidden_size=8, ffn_hidden_size=4, topology=Topology(num_domains=1, ranks_per_domain=2))
    with pytest.raises(ValueError, match="EP group has 1 ranks"):
        ExpertParallelMoE(num_experts=4, hidden_size=8, ffn_hidden_size=4, topology=Topology(num_domains=2, ranks_per_domain=1))
    for policy in OFFLINE_POLICIES:  # offline planners (seconds per plan) never run in the layer
        assert policy not in POLICIES
        with pytest.raises(ValueError, match=f"{policy!r} is an offline planner.*topoep.solve"):
            ExpertParallelMoE(num_experts=4, hidden_size=8, ffn_hidden_size=4, topology=topo, policy=policy)


def _timed(rank, world):
    from topoep.runtime import PHASES, PhaseTimer

    topo = Topology(num_domains=2, ranks_per_domain=2)
    E, T, k, H, Fd = 16, 32, 2, 8, 4
    x, idx, w, fc1, fc2, gy = make_inputs(world, E, T, k, H, Fd, 3.0, seed=4)
    layer = ExpertParallelMoE(num_experts=E, hidden_size=H, ffn_hidden_size=Fd, topology=topo, num_slots=2,
                              policy="topoep", guard=False)
    with torch.no_grad():
        layer.fc1.copy_(fc1[rank * 4:rank * 4 + 4])
        layer.fc2.copy_(fc2[rank * 4:rank * 4 + 4])
    out = []
    for timer in (None, PhaseTimer("cpu")):
        layer.timer = timer
        layer.zero_grad(set_to_none=True)
        xr = x[rank].clone().requires_grad_()
        y = layer(xr, idx[rank], w[rank])
        y.backward(gy[rank])
        out.append([y.detach(), xr.grad, layer.fc1.grad.clone(), layer.fc2.grad.clone()])
    split = {p: (timer.ms[p] - timer.ms_bwd.get(p, 0.0), timer.ms_bwd.get(p, 0.0)) for p in timer.ms}
    assert timer.pop(split=True) == split and timer.pop() == {}
    return all(torch.equal(a, b) for a, b in zip(*out)), split, layer.stats_dict()["num_replicas"], PHASES


def test_phase_timer_times_every_phase_and_changes_nothing():
    for same, ms, replicas, phases in run_ranks(_timed, 4):
        assert same, "timing serialises the pipeline but must not change a single value"
        assert replicas > 0 and set(ms) == set(phases) and all(f + b > 0 for f, b in ms.values())
        # forward or backward: planning is forward only, gradient return backward only, the rest both
        assert ms["plan"][1] == 0 and ms["grad_return"][0] == 0
        assert all(ms[p][0] > 0 and ms[p][1] > 0 for p in ("fetch", "dispatch_combine", "experts"))
