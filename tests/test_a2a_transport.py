"""Backend cuda's a2a transport (topoep/runtime/a2a.py) on the CPU: the workspace and replica pool over
gloo all-to-alls (`GlooExchange`) in 4 processes as 2 domains of 2, with plans that cross domains.

- dispatch puts every row at the position layout.receive_positions gives it (rows carry their source
  and token; in the second round scaled by a factor per assignment, as the backward's top-k weights), and
  combine brings every row back to its assignment;
- fetch fills every slot with its expert's main weights; return_grads adds every slot's gradient to its
  expert's main rank (integer-valued, so the sums are exact);
- bad transport settings are refused with the fix named.
The NVSHMEM exchange itself runs on the GPU machine (tests/test_cuda_backend_gpu.py, TOPOEP_GPU_TRANSPORT=a2a).
"""

import pytest
import torch

from distributed import run_ranks

E_LOC, N, T, K, H, F = 3, 2, 24, 2, 4, 2


def _plan(rank, world, policy, exchange, seed=0, one_hot=False):
    from topoep import Topology, solve
    from topoep.runtime.layout import count_keys

    E = world * E_LOC
    g = torch.Generator().manual_seed(100 * seed + rank)
    bias = torch.zeros(E)
    bias[:E_LOC] = 3.0  # hot experts on rank 0: balancing replicates them, across domains too
    if one_hot:  # one very hot expert: copies on several ranks of each domain (relay trees more than one deep)
        bias[0] = 8.0
    idx = torch.topk(torch.randn(T, E, generator=g) + bias, K, dim=1).indices
    omega = exchange.all_gather(count_keys(idx, E))
    plan = solve(omega, Topology(num_domains=2, ranks_per_domain=world // 2), num_slots=N, policy=policy,
                 expert_bytes=10 if one_hot else 1000, token_bytes=10)
    return idx, plan


def _rows_go_and_return(rank, world, policy, blocks):
    """Two rounds on one workspace (different routing), with room for more rows than are sent; the
    exchange checks that every split divides over `blocks` blocks per peer, as torch's NVSHMEM op does."""
    import torch.distributed as dist

    from topoep.runtime.a2a import A2AWorkspace, GlooExchange
    from topoep.runtime.layout import assignment_instances, count_keys, local_group, receive_positions

    ex = GlooExchange(blocks_per_peer=blocks)
    G = E_LOC + N
    ws = A2AWorkspace(ex, G, E_LOC, T * K + 5, H, torch.float32)
    slot_rows = cross = 0
    for seed in range(2):
        idx, plan = _plan(rank, world, policy, ex, seed)
        inst = assignment_instances(idx, plan, rank)
        key, order = torch.sort(plan.instance_rank[inst] * G + local_group(inst, plan), stable=True)
        C = ws.all_gather(count_keys(key, world * G), 1).view(world, world, G)
        dest, pos, is_slot = receive_positions(C, key, rank, E_LOC)
        x = torch.zeros(T, H)
        x[:, 0] = rank
        x[:, 1] = torch.arange(T)
        x[:, 2] = seed
        # round 2 scales every row by its assignment's factor (1-3) as it is sent (the backward's top-k weights)
        scale = (torch.arange(T * K) % 3 + 1).float() if seed else None
        recv_main, recv_slot = ws.dispatch(x, order, K, dest, pos, is_slot, scale=scale)
        # where every rank's rows should land here
        sent = [None] * world
        dist.all_gather_object(sent, (dest.tolist(), pos.tolist(), is_slot.tolist(), order.tolist()))
        placed = 0
        for s, (d, p, sl, asg) in enumerate(sent):
            for di, pi, si, ai in zip(d, p, sl, asg):
                if di != rank:
                    continue
                got = (recv_slot if si else recv_main)[pi]
                f = ai % 3 + 1 if seed else 1
                assert got[0] == s * f and got[1] == (ai // K) * f and got[2] == seed * f, (s, ai, got)
                placed += 1
        n_main, n_slot = (C[:, rank, :E_LOC].sum().view(1), C[:, rank, E_LOC:].sum().view(1))
        assert placed == int(n_main + n_slot)
        out = ws.combine(recv_main * 2 + 1, recv_slot * 2 + 1, n_main, n_slot, T * K)
        want = x.repeat_interleave(K, 0) * (scale[:, None] if seed else 1)
        assert torch.equal(out, want * 2 + 1)
        slot_rows += int(n_slot)
        cross += int((plan.instance_rank[inst] // (world // 2) != rank // (world // 2)).sum())
    return slot_rows, cross


@pytest.mark.parametrize("policy,blocks", [("static", 1), ("topoep", 3), ("deepseek", 4)])
def test_rows_arrive_in_the_layout_and_come_back(policy, blocks):
    res = run_ranks(_rows_go_and_return, 4, policy, blocks)
    slot_rows, cross = sum(r[0] for r in res), sum(r[1] for r in res)
    assert cross > 0  # rows crossed the domain boundary
    assert slot_rows == 0 if policy == "static" else slot_rows > 0  # replicas served rows


def _replicas_and_gradients(rank, world, policy, fanout=None, chunks=1):
    from topoep.relay import relay_trees
    from topoep.runtime.a2a import A2AReplicaPool, GlooExchange

    ex = GlooExchange(blocks_per_peer=3)  # weight rows of 16 and 8 elements, padded to 24
    _, plan = _plan(rank, world, policy, ex, one_hot=fanout is not None)
    relay = relay_trees(plan, fanout, chunks) if fanout else None
    pool = A2AReplicaPool(ex, N, H, F, torch.float32)
    e0 = rank * E_LOC
    W1 = torch.stack([torch.full((2 * F, H), float(e0 + i)) + torch.arange(H) for i in range(E_LOC)])
    W2 = torch.stack([torch.full((H, F), -float(e0 + i)) - torch.arange(F) for i in range(E_LOC)])
    se = plan.slot_expert
    pool.fetch(se, W1, W2, E_LOC, relay=relay)
    filled = 0
    for j in range(N):
        e = int(se[rank, j])
        if e >= 0:
            assert torch.equal(pool.fc1[j], torch.full((2 * F, H), float(e)) + torch.arange(H))
            assert torch.equal(pool.fc2[j], torch.full((H, F), -float(e)) - torch.arange(F))
            filled += 1
    # gradients: slot j of rank s has (s + 1) * 10 + j; the main rank sums them per expert
    s1, s2 = torch.empty_like(pool.fc1), torch.empty_like(pool.fc2)
    for j in range(N):
        s1[j].fill_((rank + 1) * 10 + j)
        s2[j].fill_(-((rank + 1) * 10 + j))
    slots_before = pool.fc1.clone(), pool.fc2.clone()
    # every expert starts from its own gradient, so a row written to the wrong expert shows
    base = torch.arange(E_LOC, dtype=torch.float32) * 1000 + 1
    g1, g2 = base[:, None, None].expand(E_LOC, 2 * F, H).clone(), -base[:, None, None].expand(E_LOC, H, F).clone()
    pool.return_grads(se, g1, g2, E_LOC, src=(s1, s2), relay=relay)
    assert torch.equal(pool.fc1, slots_before[0]) and torch.equal(pool.fc2, slots_before[1])  # weights kept
    for i in range(E_LOC):
        want = sum((s + 1) * 10 + j for s in range(world) for j in range(N) if int(se[s, j]) == e0 + i)
        assert torch.equal(g1[i], torch.full((2 * F, H), float(base[i]) + want))
        assert torch.equal(g2[i], torch.full((H, F), -float(base[i]) - want))
    relayed = 0 if relay is None else int(((relay.source >= 0) & (relay.source != plan.main_rank[se.clamp(min=0)])).sum())
    return filled, relayed


@pytest.mark.parametrize("policy,fanout,chunks", [("topoep", None, 1), ("deepseek", None, 1), ("topoep", 1, 1),
                                                  ("topoep_plus", 2, 1), ("deepseek", 1, 1), ("topoep", 1, 3),
                                                  ("topoep_plus", 2, 2)])
def test_replicas_are_fetched_and_gradients_return_summed(policy, fanout, chunks):
    """Directly from the homes, and down / up relay trees (LayerConfig.relay_fanout), also in chunks whose levels
    overlap (LayerConfig.relay_chunks: rows of one chunk, 24 elements here): the same slots, the same sums
    (integers: exact in any order)."""
    res = run_ranks(_replicas_and_gradients, 4, policy, fanout, chunks)
    assert sum(r[0] for r in res) > 0
    if fanout and policy != "deepseek":
        assert res[0][1] > 0  # some copy was fetched from another copy, not from its home


def test_transport_settings_are_checked():
    from app.config import EplbConfig
    from topoep.runtime.backend import make_backend

    with pytest.raises(ValueError, match="backend 'cuda''s"):
        make_backend("torch", transport="a2a")
    with pytest.raises(ValueError, match="unknown transport 'rdma'"):
        make_backend("torch", transport="rdma")
    with pytest.raises(ValueError, match="eplb.transport=a2a applies to eplb.backend=cuda"):
        EplbConfig(name="topoep", backend="torch", transport="a2a")
    with pytest.raises(ValueError, match="eplb.transport='x' is unknown"):
        EplbConfig(name="topoep", backend="cuda", transport="x")


def test_a2a_with_pipeline_parallelism_is_refused():
    from app.config import register_configs
    from app.loop import job_from_config
    from bench.eval_worker import compose

    register_configs()
    a2a = ["eplb=topoep", "eplb.backend=cuda", "eplb.transport=a2a", "eplb.capacity_factor=null"]
    with pytest.raises(ValueError, match="eplb.transport=a2a with parallel.pp=2"):
        job_from_config(compose([*a2a, "parallel.pp=2"]))
    job_from_config(compose(a2a))  # pp 1: accepted


def test_a2a_with_a_capacity_is_refused():
    """Transport a2a keeps worst-case buffers (no spill path across hosts): the trainer says to set the capacity
    off, and so does the layer (its NVSHMEM workspace would refuse regions below the worst case)."""
    from app.config import EplbConfig

    with pytest.raises(ValueError, match="set eplb.capacity_factor=null"):
        EplbConfig(name="topoep", backend="cuda", transport="a2a")
    EplbConfig(name="topoep", backend="cuda", transport="a2a", capacity_factor=None)
    from topoep import ExpertParallelMoE, Topology

    with pytest.raises(ValueError, match=r"LayerConfig.transport=a2a .* set LayerConfig.capacity_factor=null"):
        ExpertParallelMoE(num_experts=4, hidden_size=8, ffn_hidden_size=8, topology=Topology(num_domains=1, ranks_per_domain=1),
                          backend="cuda", transport="a2a")
