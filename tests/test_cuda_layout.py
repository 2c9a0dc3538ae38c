"""CPU tests of the device-side receive layout of the `cuda` backend (topoep/runtime/layout.py
`receive_positions`): every rank's rows land in a gap-free, collision-free, group-major layout in two
buffers per destination (main experts, replica slots), with sources in rank order inside a group. The
Triton version of the send and receive layout (layout_triton.py) equals it bit for bit under Triton's
interpreter."""

import pytest
import torch

from interpreter import interpreted_cases
from topoep.runtime.layout import count_keys, receive_positions, received_sizes
from topoep_research import POLICIES as RESEARCH_POLICIES


def _reference(keys, R, G, E_loc, d):
    """Rows (source, send index) rank d receives, main buffer then slot buffer, in the documented order."""
    main, slot = [], []
    for g in range(G):
        rows = [(s, i) for s in range(R) for i, kk in enumerate(keys[s].tolist()) if kk == d * G + g]
        (main if g < E_loc else slot).extend(rows)
    return main, slot


@pytest.mark.parametrize("R,E_loc,N,A,seed", [(2, 3, 2, 40, 0), (4, 2, 1, 17, 1), (3, 4, 0, 25, 2), (8, 1, 3, 64, 3),
                                               (4, 2, 2, 0, 4)])
def test_receive_positions_match_the_group_major_layout(R, E_loc, N, A, seed):
    G = E_loc + N
    g = torch.Generator().manual_seed(seed)
    keys = []
    for s in range(R):
        k = torch.randint(0, R * G, (A,), generator=g)
        if A and s == 1 % R:
            k[: A // 2] = 0  # a hot group: skewed counts
        keys.append(torch.sort(k).values)  # send order: by destination, then group
    C = torch.stack([count_keys(k, R * G).view(R, G) for k in keys])
    placed = {(d, b): {} for d in range(R) for b in (False, True)}
    for s in range(R):
        dest, pos, is_slot = receive_positions(C, keys[s], s, E_loc)
        assert torch.equal(dest, keys[s] // G)
        assert torch.equal(is_slot, keys[s] % G >= E_loc)
        for i, (d, p, b) in enumerate(zip(dest.tolist(), pos.tolist(), is_slot.tolist())):
            assert p not in placed[d, b], "two rows written to one position"
            placed[d, b][p] = (s, i)
    for d in range(R):
        main, slot = _reference(keys, R, G, E_loc, d)
        sizes_main, sizes_slot = received_sizes(C, d, E_loc)
        assert int(sizes_main.sum()) == len(main) and int(sizes_slot.sum()) == len(slot)
        assert [placed[d, False][p] for p in range(len(main))] == main  # gap-free and in order
        assert [placed[d, True][p] for p in range(len(slot))] == slot
        assert len(placed[d, False]) == len(main) and len(placed[d, True]) == len(slot)


def test_count_keys_matches_bincount():
    k = torch.tensor([3, 0, 3, 5, 5, 5])
    assert torch.equal(count_keys(k, 7), torch.bincount(k, minlength=7))
    assert torch.equal(count_keys(torch.empty(0, dtype=torch.int64), 4), torch.zeros(4, dtype=torch.int64))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_backend_cuda_without_a_gpu_says_to_use_torch():
    from topoep.runtime.backend import make_backend

    with pytest.raises(ValueError, match="backend 'cuda' needs a CUDA GPU; use backend='torch'"):
        make_backend("cuda")
    with pytest.raises(ValueError, match="unknown backend 'nvshmem'; choose one of torch, cuda"):
        make_backend("nvshmem")


class _OneRankWorkspace:
    """The only part of symm.SymmWorkspace that the metadata uses, for a single rank on the CPU: one receive region
    of a_cap rows (the worst case at EP 1)."""

    def __init__(self, a_cap):
        self.a_cap, self.regions = a_cap, (a_cap,)

    def all_gather(self, row, which):
        return row[None].clone()


def test_cuda_metadata_on_one_rank_gives_offsets_and_counts_of_the_layout():
    """ExpertParallelMoE._cuda_metadata (what backend cuda captures as a CUDA graph) on the CPU: the
    grouped-GEMM offsets and row counts it returns describe exactly the rows the layout sends."""
    from topoep import ExpertParallelMoE, Topology

    E, N, T, k = 8, 2, 40, 2
    layer = ExpertParallelMoE(num_experts=E, hidden_size=8, ffn_hidden_size=4, topology=Topology(num_domains=1, ranks_per_domain=1),
                              num_slots=N, policy="topoep", guard=False)
    g = torch.Generator().manual_seed(0)
    topk_idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    out = layer._cuda_metadata(_OneRankWorkspace(T * k), topk_idx, torch.tensor(True), token_bytes=16)
    omega, slot_expert, route, stats, wanted, relay, order, dest, pos, is_slot, offs_main, offs_slot, n_main, n_slot = \
        out[:14]
    assert int(out[-1]) == 0  # the spill work: no row beyond the region
    assert wanted.dtype == torch.bool and not wanted  # no guard: no decision
    assert relay.numel() == 0  # no relay_fanout: no relay trees
    assert torch.equal(omega[0], count_keys(topk_idx, E))
    assert torch.equal(torch.sort(order).values, torch.arange(T * k))  # every assignment sent once
    assert torch.equal(dest, torch.zeros(T * k, dtype=torch.int64))
    assert offs_main.dtype == torch.int32 and offs_main.numel() == E and offs_slot.numel() == N
    assert int(n_main) == int((~is_slot).sum()) == int(offs_main[-1])
    assert int(n_slot) == int(is_slot.sum()) == (int(offs_slot[-1]) if N else 0)
    for buffer in (~is_slot, is_slot):  # positions: a permutation of each buffer's rows
        assert torch.equal(torch.sort(pos[buffer]).values, torch.arange(int(buffer.sum())))
    assert stats.numel() > 0 and route.shape == (1, E + N)


@pytest.mark.parametrize("policy", ["static", "topoep", "deepseek", *RESEARCH_POLICIES])
@pytest.mark.parametrize("R,E_loc,N,T,k,seed", [(2, 4, 2, 30, 2, 0), (4, 3, 1, 25, 3, 1), (4, 2, 2, 0, 2, 2),
                                                 (8, 2, 3, 40, 4, 3)])
def test_send_layout_equals_the_stable_sort_and_its_counts_the_exchange(policy, R, E_loc, N, T, k, seed):
    """layout.send_layout (no sort, counts read off the plan) gives what the sort of the destination keys
    and the all-gathered key counts give, for every source rank of plans with replicas."""
    from topoep import Topology, solve
    from topoep.runtime.layout import assignment_instances, local_group, send_layout

    E, G = R * E_loc, E_loc + N
    g = torch.Generator().manual_seed(seed)
    bias = torch.zeros(E)
    bias[:E_loc] = 2.5  # hot experts on rank 0: replicas take their rows
    idx = [torch.topk(torch.randn(T, E, generator=g) + bias, k, dim=1).indices for _ in range(R)]
    omega = torch.stack([count_keys(i, E) for i in idx])
    plan = solve(omega, Topology(num_domains=2 if R > 2 else 1, ranks_per_domain=R // 2 if R > 2 else R),
                 num_slots=N, policy=policy, expert_bytes=1000, token_bytes=10)
    keys = []
    for s in range(R):
        inst = assignment_instances(idx[s], plan, s)
        key, order = torch.sort(plan.instance_rank[inst] * G + local_group(inst, plan), stable=True)
        C, key2, order2 = send_layout(idx[s], plan, s)
        assert torch.equal(order2, order) and torch.equal(key2, key)
        keys.append(key)
    C_exchanged = torch.stack([count_keys(kk, R * G).view(R, G) for kk in keys])
    assert torch.equal(C, C_exchanged)
    if policy != "static" and T:
        assert int(C[:, :, E_loc:].sum()) > 0  # replica slots received rows


def test_assignment_ordinals_count_within_each_expert():
    from topoep.runtime.layout import assignment_ordinals

    e = torch.tensor([2, 0, 2, 2, 1, 0])
    assert assignment_ordinals(e, count_keys(e, 3)).tolist() == [0, 0, 1, 2, 0, 1]


def test_triton_layout_equals_the_torch_layout_in_the_interpreter():
    """tests/layout_triton_check.py in a subprocess with TRITON_INTERPRET=1 (read when triton is imported)."""
    lines = interpreted_cases("layout_triton_check.py")
    assert len(lines) == 17 and all("equal on every rank" in ln for ln in lines[:14]), lines
    assert "checked_counts equal count_keys, and values outside [0, E) are rejected" in lines[14], lines
    # plans that do not route this rank's assignments of every expert, or route one to an empty slot
    assert "rejected (" in lines[15] and "rejected (" in lines[16], lines
    assert any("(0 replicas)" not in ln for ln in lines)  # replicas exercised


@pytest.mark.parametrize("seed", range(4))
def test_two_chunks_send_every_assignment_to_the_instance_of_the_whole_call(seed):
    """Backend cuda's two chunks (LayerConfig.num_chunks=2): each rank's route row split at the token boundary
    (layout.chunk_route_row) gives each chunk's assignments the very instances the whole call's route gives
    them, and the two chunk routes add up to the call's."""
    import dataclasses

    from topoep import Topology, solve
    from topoep.runtime.layout import assignment_instances, chunk_route_row
    from topoep.workloads import biased_topk

    R, E, N, T, k = 4, 32, 3, 37 + seed, 4
    idx = list(biased_topk(R, E, T, k, -3.0, seed=seed, layout="concentrated" if seed % 2 else "random").unbind(0))
    omega = torch.stack([torch.bincount(i.reshape(-1), minlength=E) for i in idx])
    plan = solve(omega, Topology(num_domains=2, ranks_per_domain=2), num_slots=N, policy="topoep",
                 expert_bytes=1000, token_bytes=100)
    assert (plan.slot_expert >= 0).any()
    T1 = (T + 1) // 2
    route1 = torch.stack([chunk_route_row(plan.route[r], plan.instance_expert, count_keys(idx[r][:T1], E))
                          for r in range(R)])
    assert (route1 >= 0).all() and (route1 <= plan.route).all()
    for r in range(R):
        whole = assignment_instances(idx[r], plan, r)
        parts = []
        for rows, route in ((idx[r][:T1], route1), (idx[r][T1:], plan.route - route1)):
            omega_c = torch.zeros_like(plan.omega).index_add_(1, plan.instance_expert.clamp(min=0), route)
            assert torch.equal(omega_c[r], torch.bincount(rows.reshape(-1), minlength=E))
            parts.append(assignment_instances(rows, dataclasses.replace(plan, route=route, omega=omega_c), r))
        assert torch.equal(torch.cat(parts), whole)
