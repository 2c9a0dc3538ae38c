"""Backend torch with relayed replica fetches (LayerConfig.relay_fanout, topoep.relay) on gloo processes, 8 ranks as
2 domains of 4 under a strong skew: the same outputs bit for bit as fetching every copy from its home, the same
gradients up to float summation order (and equal to the dense reference), bit-identical from run to run, level by
level or copy by copy (LayerConfig.relay_schedule), and the trees really relay (copies fetched from other copies,
more than one level)."""

import dataclasses
import itertools

import pytest
import torch

from distributed import run_ranks
from test_relay import copies_at_home, nic_relays
from test_runtime_multirank import dense_reference, make_inputs
from topoep import ExpertParallelMoE, LayerConfig, Topology
from topoep.relay import max_level, relay_sources


# (name, relay_fanout, relay_chunks, relay_schedule): copies in 3 chunks whose levels overlap (relay2_c3: a weight of
# 2 F H elements does not divide into 3 equal chunks here); copy by copy (async)
RUNS = (("direct", None, 1, "levels"), ("relay1", 1, 1, "levels"), ("relay2", 2, 1, "levels"),
        ("relay2_again", 2, 1, "levels"), ("relay2_c3", 2, 3, "levels"), ("relay1_c4", 1, 4, "levels"),
        ("relay1_async", 1, 1, "async"), ("relay2_async", 2, 1, "async"), ("relay3_async", 3, 1, "async"),
        ("relay3", 3, 1, "levels"))


def _relay(rank, world, rpd):
    E_loc, T, k, H, Fd, N = 2, 32, 2, 8, 6, 3
    R, E = world, world * E_loc
    topo = Topology(num_domains=world // rpd, ranks_per_domain=rpd)
    x, idx, w, fc1, fc2, gy = make_inputs(R, E, T, k, H, Fd, 4.0, seed=11)
    # expert 0 in every token's choices (once): a hot expert with copies on many ranks of both domains
    idx[..., 0] = torch.where(idx[..., 1] == 0, idx[..., 0], torch.zeros_like(idx[..., 0]))
    ref = dense_reference(x, idx, w, fc1, fc2, gy)
    lo, hi = rank * E_loc, (rank + 1) * E_loc
    out = {}
    for name, fanout, chunks, schedule in RUNS:
        layer = ExpertParallelMoE(num_experts=E, hidden_size=H, ffn_hidden_size=Fd, topology=topo,
                                  config=LayerConfig(policy="topoep_plus", num_slots=N, guard=False,
                                                     relay_fanout=fanout, relay_chunks=chunks,
                                                     relay_schedule=schedule))
        with torch.no_grad():
            layer.fc1.copy_(fc1[lo:hi])
            layer.fc2.copy_(fc2[lo:hi])
        xr, wr = x[rank].clone().requires_grad_(), w[rank].clone().requires_grad_()
        y = layer(xr, idx[rank], wr)
        (y * gy[rank]).sum().backward()
        got = [y.detach(), xr.grad, wr.grad, layer.fc1.grad.clone(), layer.fc2.grad.clone()]
        want = [ref[0][rank], ref[1][rank], ref[2][rank], ref[3][lo:hi], ref[4][lo:hi]]
        for a, b in zip(got, want):
            torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)
        source, level = relay_sources(layer.last_plan, fanout or 1)
        home = layer.last_plan.main_rank[layer.last_plan.slot_expert.clamp(min=0)]
        relayed = int(((source >= 0) & (source != home)).sum())
        out[name] = (got, relayed, int(level.max()), nic_relays(layer.last_plan, source))
    return out



@pytest.mark.parametrize("rpd", [4, 2])
def test_relayed_fetch_and_tree_return_match_the_direct_path(rpd):
    """8 ranks as 2 domains of 4, and as 4 domains of 2 (the remote domains' first copies relay across the NIC)."""
    for out in run_ranks(_relay, 8, rpd):
        direct, relay1, relay2, again = (out[k][0] for k in ("direct", "relay1", "relay2", "relay2_again"))
        for got in (relay1, relay2):
            assert torch.equal(got[0], direct[0])  # forward: the same weights in the same slots
            for a, b in zip(got[1:], direct[1:]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # gradients: another summation order
        assert all(torch.equal(a, b) for a, b in zip(relay2, again))  # a fixed order: bit-reproducible
        # chunked: element by element the same copies and the same sums in the same order as level by level
        for chunked, plain in (("relay2_c3", "relay2"), ("relay1_c4", "relay1")):
            assert all(torch.equal(a, b) for a, b in zip(out[chunked][0], out[plain][0])), chunked
        # copy by copy: the same copies, and every node adds its children's gradients in the same order
        for copies, plain in (("relay1_async", "relay1"), ("relay2_async", "relay2"), ("relay3_async", "relay3")):
            assert all(torch.equal(a, b) for a, b in zip(out[copies][0], out[plain][0])), copies
        assert out["relay1"][1] >= 4 and out["relay1"][2] >= 3  # chains: copies sent on by other copies
        assert (out["relay1"][3] > 0) == (rpd == 2)  # a domain's first copy sent on to another domain


def relay_cuda(rank, world, rpd, chunks, prefetch, options=None):
    """Backend cuda, bf16: two layers sharing the slots (the earlier one reloads), or with `prefetch` four (banks
    refilled beside the backward), directly and down relay trees. On the CPU harness (a2a pool on gloo) without
    `options`; with them (LayerConfig fields: tests/test_cuda_backend_gpu.py's cuda_options) on this rank's GPU."""
    dev = "cpu"
    if options is not None:
        from distributed import rank_device

        dev = rank_device(rank)
        torch.cuda.set_device(dev)
    E_loc, T, k, H, Fd, N = 2, 32, 2, 16, 8, 3
    R, E = world, world * E_loc
    topo = Topology(num_domains=world // rpd, ranks_per_domain=rpd)
    lo, hi = rank * E_loc, (rank + 1) * E_loc
    inputs = []
    for seed in range(11, 15 if prefetch else 13):
        x, idx, w, fc1, fc2, gy = make_inputs(R, E, T, k, H, Fd, 4.0, seed=seed)
        idx[..., 0] = torch.where(idx[..., 1] == seed % 2, idx[..., 0], torch.full_like(idx[..., 0], seed % 2))
        inputs.append((x, idx, w, fc1, fc2, gy))
    out, before = {}, (0, 0, 0)
    for name, fanout, relay_chunks, schedule in RUNS:
        peer = options is not None and options.get("transport", "peer") == "peer"
        if schedule != "levels" and not peer:  # copy by copy: the peer transport on the GPU (not the CPU harness)
            continue
        layers, losses, leaves = [], [], []
        for x, idx, w, fc1, fc2, gy in inputs:
            fields = dict(options or {}, policy="topoep_plus", num_slots=N, guard=False, backend="cuda",
                          relay_fanout=fanout, relay_chunks=relay_chunks, num_chunks=chunks, prefetch=prefetch,
                          relay_schedule=schedule)
            layer = ExpertParallelMoE(num_experts=E, hidden_size=H, ffn_hidden_size=Fd, topology=topo,
                                      config=LayerConfig(**fields), dtype=torch.bfloat16, device=dev,
                                      **({} if options is not None else {"_cpu_harness": True}))
            with torch.no_grad():
                layer.fc1.copy_(fc1[lo:hi])
                layer.fc2.copy_(fc2[lo:hi])
            xr = x[rank].to(dev, torch.bfloat16).requires_grad_()
            wr = w[rank].to(dev, torch.bfloat16).requires_grad_()
            y = layer(xr, idx[rank].to(dev), wr)
            losses.append((y.detach(), (y * gy[rank].to(dev, torch.bfloat16)).sum()))
            layers.append(layer)
            leaves.append((xr, wr))
        for _, loss in reversed(losses):
            loss.backward()
        got = []
        for layer, (y, _), (xr, wr) in zip(layers, losses, leaves):
            got += [t.cpu() for t in (y, xr.grad, wr.grad, layer.fc1.grad, layer.fc2.grad)]
        plan = layers[0].last_plan
        source, level = (t.cpu() for t in relay_sources(plan, fanout or 1))
        home = plan.main_rank.cpu()[plan.slot_expert.cpu().clamp(min=0)]
        relayed = int(((source >= 0) & (source != home)).sum())
        pool = layers[0].pool  # shared by the runs: their counts are the differences
        counts = (pool.fills, pool.reloads_skipped, pool.prefetches)
        out[name] = (got, relayed, int(level.max()), tuple(c - p for c, p in zip(counts, before)),
                     nic_relays(plan, source))
        before = counts
    return out


def check_relays(results, prefetch, domains=2):
    """relay_cuda's results on every rank: relayed fetches give the same slots, so the same outputs bit for bit; the
    tree return gives the same gradients up to bf16 rounding of the relays' partial sums; runs repeat bit for bit;
    reloads and prefetches happen as on the direct path; copies were fetched from other copies."""
    for out in results:
        direct = out["direct"][0]
        for name in ("relay1", "relay2"):
            got = out[name][0]
            for i, (a, b) in enumerate(zip(got, direct)):
                if i % 5 == 0:
                    assert torch.equal(a, b), f"{name}: output of layer {i // 5} differs"
                else:  # a relay rounds its subtree's sum to bf16 before sending it on: a few bf16 steps of the largest
                    torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=2 ** -6 * float(b.abs().max()))
            assert out[name][3] == out["direct"][3]  # the same fills, reloads left out, prefetches
        assert out["direct"][3][2 if prefetch else 1] >= 1  # prefetches happened / a reload was left out
        assert all(torch.equal(a, b) for a, b in zip(out["relay2"][0], out["relay2_again"][0]))
        # chunked trees: the same slots (outputs bit for bit) and the same sums element by element
        for chunked, plain in (("relay2_c3", "relay2"), ("relay1_c4", "relay1")):
            assert all(torch.equal(a, b) for a, b in zip(out[chunked][0], out[plain][0])), chunked
            assert out[chunked][3] == out["direct"][3]
        # copy by copy (the peer transport on the GPU): the same slots and the same sums in the same order
        for copies, plain in (("relay1_async", "relay1"), ("relay2_async", "relay2"), ("relay3_async", "relay3")):
            if copies in out:
                assert all(torch.equal(a, b) for a, b in zip(out[copies][0], out[plain][0])), copies
                assert out[copies][3] == out["direct"][3]
        assert out["relay1"][1] >= 1 and out["relay1"][2] >= 2  # copies fetched from other copies
        if domains > 2:  # a domain's first copy sent on to another domain
            assert out["relay1"][4] > 0


@pytest.mark.parametrize("domains,rpd,chunks,prefetch", [(2, 2, 1, False), (2, 2, 2, True), (4, 1, 1, False),
                                                         pytest.param(2, 4, 1, False, marks=pytest.mark.slow)])
def test_backend_cuda_relays_match_its_direct_path(domains, rpd, chunks, prefetch):
    """Backend cuda's a2a pool on the CPU harness, `domains` domains of rpd ranks (check_relays; 4 domains: the remote
    domains' first copies relay across the NIC). The peer-pointer pool runs the same check on the GPU
    (tests/test_cuda_backend_gpu.py)."""
    check_relays(run_ranks(relay_cuda, domains * rpd, rpd, chunks, prefetch), prefetch, domains)


def test_the_layers_guard_prices_the_relayed_fetch():
    """A layer with relay_fanout gives its guard the same fanout (it prices the fetch that runs), unless the guard
    passed in has its own."""
    from topoep.runtime.guard import NetBenefitGuard

    topo = Topology(num_domains=1, ranks_per_domain=1)
    kw = dict(num_experts=4, hidden_size=16, ffn_hidden_size=8, topology=topo)
    assert ExpertParallelMoE(**kw, relay_fanout=2).guard.relay_fanout == 2
    assert ExpertParallelMoE(**kw).guard.relay_fanout is None
    assert ExpertParallelMoE(**kw, relay_fanout=2, guard=NetBenefitGuard(relay_fanout=1)).guard.relay_fanout == 1


def test_relay_fanout_is_checked():
    with pytest.raises(ValueError, match="LayerConfig.relay_fanout must be an integer >= 1, got 0"):
        LayerConfig(relay_fanout=0)
    with pytest.raises(ValueError, match="fanout must be an integer >= 1"):
        max_level(Topology(num_domains=2, ranks_per_domain=4), 0)
    # one level per depth of a tree over a domain's ranks, plus one per depth of the NIC tree over the domains
    assert [max_level(Topology(num_domains=m, ranks_per_domain=d), f) for m, d, f in
            ((1, 1, 2), (1, 4, 2), (2, 4, 2), (2, 4, 1), (4, 8, 2), (2, 8, 8), (16, 8, 2), (4, 8, 1))] == [
                1, 2, 3, 4, 5, 2, 7, 10]


def test_relay_chunks_are_checked_and_reach_the_guard():
    """LayerConfig.relay_chunks: an integer 1-64 that needs relay_fanout; the layer's guard prices the chunks that
    run."""
    from topoep.runtime.guard import NetBenefitGuard

    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="LayerConfig.relay_chunks must be an integer >= 1"):
            LayerConfig(relay_fanout=2, relay_chunks=bad)
    with pytest.raises(ValueError, match="at most 64 chunks"):
        LayerConfig(relay_fanout=2, relay_chunks=65)
    with pytest.raises(ValueError, match="relay_fanout is null"):
        LayerConfig(relay_chunks=4)
    with pytest.raises(ValueError, match="relay_share=true bounds the senders"):
        LayerConfig(relay_share=True)
    with pytest.raises(ValueError, match="NetBenefitGuard.relay_chunks must be an integer >= 1"):
        NetBenefitGuard(relay_fanout=2, relay_chunks=0)
    with pytest.raises(ValueError, match="NetBenefitGuard.relay_share must be true or false"):
        NetBenefitGuard(relay_fanout=2, relay_share=1)
    topo = Topology(num_domains=1, ranks_per_domain=1)
    layer = ExpertParallelMoE(num_experts=4, hidden_size=16, ffn_hidden_size=8, topology=topo, relay_fanout=2,
                              relay_chunks=4, relay_share=True)
    assert (layer.guard.relay_fanout, layer.guard.relay_chunks, layer.guard.relay_share) == (2, 4, True)
    # a guard passed in keeps its fanout, and gets the chunks that run and the layer's sender bound
    layer = ExpertParallelMoE(num_experts=4, hidden_size=16, ffn_hidden_size=8, topology=topo, relay_fanout=2,
                              relay_chunks=3, relay_share=True, guard=NetBenefitGuard(relay_fanout=1))
    assert (layer.guard.relay_fanout, layer.guard.relay_chunks, layer.guard.relay_share) == (1, 3, True)


def test_relay_schedule_is_checked_and_reaches_the_guard():
    """LayerConfig.relay_schedule: levels or async; async needs relay_fanout, one chunk and backend torch or backend
    cuda's peer transport; the layer's guard prices the schedule that runs, copy by copy never above level by
    level."""
    from topoep.relay import async_fetch_fs
    from topoep.runtime.guard import SECONDS_PER_FS, NetBenefitGuard
    from topoep.workloads import biased_routing

    with pytest.raises(ValueError, match="LayerConfig.relay_schedule='tree' is unknown; choose one of levels, async"):
        LayerConfig(relay_fanout=2, relay_schedule="tree")
    with pytest.raises(ValueError, match="relay_schedule=async runs the relay trees copy by copy, but "
                                         "LayerConfig.relay_fanout is null"):
        LayerConfig(relay_schedule="async")
    with pytest.raises(ValueError, match="set LayerConfig.relay_chunks=1 \\(got 2\\)"):
        LayerConfig(relay_fanout=2, relay_chunks=2, relay_schedule="async")
    with pytest.raises(ValueError, match="relay_schedule=async runs on backend torch and on backend cuda's peer "
                                         "transport"):
        LayerConfig(relay_fanout=2, relay_schedule="async", backend="cuda", transport="a2a", capacity_factor=None)
    assert LayerConfig(relay_fanout=2, relay_schedule="async", backend="cuda").relay_schedule == "async"
    with pytest.raises(ValueError, match="NetBenefitGuard.relay_schedule must be one of levels, async"):
        NetBenefitGuard(relay_fanout=2, relay_schedule="copies")
    with pytest.raises(ValueError, match="relay_chunks must be 1, got 3"):
        NetBenefitGuard(relay_fanout=2, relay_chunks=3, relay_schedule="async")
    one = Topology(num_domains=1, ranks_per_domain=1)
    layer = ExpertParallelMoE(num_experts=4, hidden_size=16, ffn_hidden_size=8, topology=one, relay_fanout=2,
                              relay_schedule="async")
    assert (layer.guard.relay_fanout, layer.guard.relay_schedule) == (2, "async")
    levels = ExpertParallelMoE(num_experts=4, hidden_size=16, ffn_hidden_size=8, topology=one, relay_fanout=2)
    assert levels.guard.relay_schedule == "levels"
    from topoep import solve

    topo = Topology(num_domains=2, ranks_per_domain=4)
    plan = solve(biased_routing(8, 16, 256, 2, -4.0, seed=3, layout="clustered"), topo, num_slots=3,
                 policy="topoep_plus", expert_bytes=1 << 20, token_bytes=64)
    guard = NetBenefitGuard(relay_fanout=2, relay_share=True, relay_schedule="async", transfer_latency_s=1e-5)
    t, relay = guard.fetch_choice(plan, 1)
    fs, steps = async_fetch_fs(plan, 2, topo)
    assert bool(relay) and float(t) == float(fs.double() * SECONDS_PER_FS + steps.double() * 1e-5)
    assert float(t) <= float(dataclasses.replace(guard, relay_schedule="levels").fetch_choice(plan, 1)[0])


def _own_copy(rank, world, seed):
    """A layer whose capacity step gives an expert's home rank a slot holding that expert (1 domain of 4, topoep_plus,
    1 slot, capacity_factor 1, a steep routing): outputs and gradients per schedule."""
    E_loc, T, k, H, Fd = 2, 32, 2, 8, 6
    E = world * E_loc
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(E, generator=g) ** 6 + 1e-3
    idx = [torch.multinomial(p.expand(T, E), k, generator=g) for _ in range(world)][rank]
    g = torch.Generator().manual_seed(100 + rank)
    x, w = torch.randn(T, H, generator=g), torch.rand(T, k, generator=g)
    out = {}
    for name, fanout, schedule in (("direct", None, "levels"), ("levels", 1, "levels"), ("async", 1, "async")):
        torch.manual_seed(0)
        layer = ExpertParallelMoE(num_experts=E, hidden_size=H, ffn_hidden_size=Fd,
                                  topology=Topology(num_domains=1, ranks_per_domain=world),
                                  config=LayerConfig(policy="topoep_plus", num_slots=1, guard=False,
                                                     capacity_factor=1.0, relay_fanout=fanout, relay_schedule=schedule))
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = layer(xr, idx, wr)
        y.sum().backward()
        own = int(copies_at_home(layer.last_plan).sum())
        out[name] = ([y.detach(), xr.grad, wr.grad, layer.fc1.grad.clone(), layer.fc2.grad.clone()], own)
    return out


def test_a_copy_on_its_home_rank_returns_its_gradient_copy_by_copy():
    """The capacity step placed a copy of an expert on its own home rank: it is copied within that rank, not relayed,
    so the copy-by-copy return neither waits for it nor drops its gradient; the same sums bit for bit as level by
    level, and the outputs and gradients of the direct fetch."""
    for out in run_ranks(_own_copy, 4, 95):
        assert out["async"][1] > 0  # the plan has such a copy
        for a, b in zip(out["async"][0], out["levels"][0]):
            assert torch.equal(a, b)
        for a, b in zip(out["levels"][0], out["direct"][0]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# (relay_fanout or None: direct, relay_chunks, bank, the guard's relay choice or None, relay_schedule) of the pool
# check below; bank 1 and the guard's choice for the a2a pool only, "async" for backend torch only
POOL_FETCHES = ((None, 1, 0, None, "levels"), (1, 1, 0, None, "levels"), (2, 1, 1, None, "levels"),
                (1, 3, 0, None, "levels"), (2, 2, 1, None, "levels"), (3, 4, 0, None, "levels"),
                (2, 3, 0, False, "levels"), (1, 1, 0, None, "async"), (2, 1, 0, None, "async"),
                (3, 1, 0, None, "async"))


def _pools_on_copies_at_home(rank, world):
    """The replica transfers on gloo, on slot tables with copies on their experts' home ranks (tests/test_relay.py
    `_self_copy_plans` at this EP): backend cuda's a2a pool (its GPU code but the exchange; two banks) and backend
    torch's. Every fetch of POOL_FETCHES fills each slot with its expert's weights, and the gradient return adds
    every copy's gradient to its home once. Integer-valued tensors: every sum is exact. Returns (what differed, the
    cases each backend ran)."""
    from test_relay import _self_copy_plans

    from topoep.relay import relay_trees
    from topoep.runtime.a2a import A2AReplicaPool, GlooExchange
    from topoep.runtime.backend import TorchBackend
    from topoep.runtime.pool import ReplicaPool

    H, F = 4, 2
    errors, pool, torch_backend, ran = [], None, TorchBackend(), {"a2a": 0, "torch": 0}
    for (p, plan), backend, (fanout, chunks, bank, use, schedule) in itertools.product(
            enumerate(q for q in _self_copy_plans() if q.num_ranks == world), ("a2a", "torch"), POOL_FETCHES):
        if (backend == "a2a" and schedule == "async") or (backend == "torch" and (bank or use is not None)):
            continue
        ran[backend] += 1
        e_loc, N, se = plan.num_experts // world, plan.num_slots, plan.slot_expert
        e0 = rank * e_loc
        W1 = torch.stack([torch.full((2 * F, H), float(e0 + i)) + torch.arange(H) for i in range(e_loc)])
        W2 = torch.stack([torch.full((H, F), -float(e0 + i)) - torch.arange(F) for i in range(e_loc)])
        run = dataclasses.replace(plan, info={} if use is None else {"relay": torch.tensor(use)})
        if backend == "a2a":
            if pool is None or pool.num_slots != N:
                pool = A2AReplicaPool(GlooExchange(blocks_per_peer=1), N, H, F, torch.float32, banks=2)
            relay = relay_trees(run, fanout, chunks) if fanout else None
            pool.fetch(se, W1, W2, e_loc, bank=bank, relay=relay)
            fc1, fc2 = pool.bank_weights(bank)
        else:
            slots = ReplicaPool(N, H, F)
            torch_backend.fetch_replicas(run, list(W1), list(W2), slots, fanout, chunks, schedule)
            fc1, fc2 = slots.fc1, slots.fc2
        case = (p, backend, fanout, chunks, bank, use, schedule)
        for j in range(N):
            e = int(se[rank, j])
            if e >= 0 and not (torch.equal(fc1[j], torch.full((2 * F, H), float(e)) + torch.arange(H))
                               and torch.equal(fc2[j], torch.full((H, F), -float(e)) - torch.arange(F))):
                errors.append(("weights", case, rank, j, e))
        s1 = torch.stack([torch.full((2 * F, H), float(10 * (rank + 1) + j)) for j in range(N)])
        s2 = -torch.stack([torch.full((H, F), float(10 * (rank + 1) + j)) for j in range(N)])
        g1 = torch.stack([torch.full((2 * F, H), 1000.0 * (i + 1)) for i in range(e_loc)])
        g2 = -g1[:, :H, :F].clone()
        if backend == "a2a":
            pool.return_grads(se, g1, g2, e_loc, src=(s1, s2), relay=relay)
        else:  # the slots hold their gradients; the main gradients are a list per expert
            slots.fc1.copy_(s1)
            slots.fc2.copy_(s2)
            torch_backend.return_grads(run, slots, list(g1), list(g2), fanout, chunks, schedule)
        for i in range(e_loc):
            want = sum(10 * (r + 1) + j for r in range(world) for j in range(N) if int(se[r, j]) == e0 + i)
            if not (torch.equal(g1[i], torch.full((2 * F, H), 1000.0 * (i + 1) + want))
                    and torch.equal(g2[i], torch.full((H, F), -1000.0 * (i + 1) - want))):
                errors.append(("gradient", case, rank, i, float(g1[i].flatten()[0]) - 1000.0 * (i + 1), want))
    return errors, ran


@pytest.mark.parametrize("world", [6, 8])
def test_pools_fill_and_return_with_copies_on_home_ranks(world):
    """The a2a pool (backend cuda's NVSHMEM transport, on gloo here) and backend torch's transfers with a copy of an
    expert in a slot of its own home rank (the capacity step's; fetched within the rank, no node of a tree) among
    relayed copies: direct, level by level with chunks, copy by copy (backend torch), into either bank and with the
    guard's direct choice (the a2a pool)."""
    from test_relay import _self_copy_plans

    plans = [q for q in _self_copy_plans() if q.num_ranks == world]
    assert plans and any(bool(copies_at_home(q).any()) for q in plans)
    assert max(int(relay_sources(q, 1)[1].max()) for q in plans) >= 3  # chains of relays
    out = run_ranks(_pools_on_copies_at_home, world)
    assert [e for errs, _ in out for e in errs] == []
    per_plan = {"a2a": 7, "torch": 7}  # POOL_FETCHES each backend runs
    assert all(ran == {k: v * len(plans) for k, v in per_plan.items()} for _, ran in out)
