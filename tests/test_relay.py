"""topoep.relay: relay trees of replica fetches. On random plans of every policy, the tensor code equals a plain
Python walk of the rule; every tree is valid (each copy's source holds the same expert or is its home, no cycle,
levels one more than the source's, one NIC crossing per remote domain, at most `fanout` children per node over
NVLink and over the NIC); a hot expert's home sends at most 2 fanout copies instead of one per copy."""

import dataclasses
import itertools

import pytest
import torch

from topoep import Topology, links, solve
from topoep.relay import max_children, max_level, relay_levels, relay_sources, relay_trees
from topoep.workloads import biased_routing


def _plans():
    for (M, d, e_loc, N), policy, seed in itertools.product([(2, 4, 2, 2), (3, 2, 2, 3), (1, 6, 1, 4), (4, 2, 1, 2)],
                                                           ("topoep", "topoep_plus", "deepseek", "flexmoe"), range(2)):
        topo = Topology(num_domains=M, ranks_per_domain=d)
        R = M * d
        omega = biased_routing(R, R * e_loc, 64, 2, -4.0, seed=seed, layout="clustered")
        yield solve(omega, topo, num_slots=N, policy=policy, expert_bytes=1000, token_bytes=10)


def _reference(plan, fanout):
    """The rule of topoep.relay written as loops: per (expert, domain), copies in order of their rank's duty, then
    in slot order; the remote domains' roots below the home as a heap of `fanout` children, the domains in cyclic
    order from the home's."""
    R, N, d, M = plan.num_ranks, plan.num_slots, plan.topology.ranks_per_domain, plan.topology.num_domains
    se = plan.slot_expert.tolist()
    source = [[-1] * N for _ in range(R)]
    level = [[0] * N for _ in range(R)]
    groups = {}
    for r in range(R):
        for n in range(N):
            if se[r][n] >= 0 and r == int(plan.main_rank[se[r][n]]):  # a copy on its home rank: within the rank
                source[r][n], level[r][n] = r, 1
            elif se[r][n] >= 0:
                groups.setdefault((se[r][n], r // d), []).append((r, n))
    # a rank's duty: how many of its experts have a copy somewhere; a domain's copies in order of (duty, rank, slot)
    duty = [0] * R
    for e in {e for row in se for e in row if e >= 0}:
        duty[int(plan.main_rank[e])] += 1
    for key in groups:
        groups[key].sort(key=lambda c: (duty[c[0]], c[0], c[1]))
    # the NIC tree of each expert: [home, the remote domains' roots in cyclic domain order from the home's]
    nic_nodes, nic_depth = {}, {}
    for e in {e for (e, _) in groups}:
        h = int(plan.main_rank[e])
        nodes = [(h, None)] + [(groups[(e, dom)][0][0], dom) for dom in ((h // d + q) % M for q in range(1, M))
                               if (e, dom) in groups]
        nic_depth[(e, None)] = 0
        for i in range(1, len(nodes)):
            nic_depth[(e, nodes[i][1])] = nic_depth[(e, nodes[(i - 1) // fanout][1])] + 1
        nic_nodes[e] = nodes
    for (e, dom), copies in groups.items():
        h = int(plan.main_rank[e])
        local = dom == h // d
        nodes = ([(h, None)] if local else []) + copies
        depth = {}
        for i, (r, n) in enumerate(nodes):
            if n is None:
                depth[i] = 0
                continue
            if i == 0:  # a remote domain's root: from its parent in the NIC tree
                at = [k for k, (_, m) in enumerate(nic_nodes[e]) if m == dom][0]
                source[r][n], depth[i] = nic_nodes[e][(at - 1) // fanout][0], nic_depth[(e, dom)]
            else:
                parent = (i - 1) // fanout
                source[r][n], depth[i] = nodes[parent][0], depth[parent] + 1
            level[r][n] = depth[i]
    return source, level


@pytest.mark.parametrize("fanout", [1, 2, 3])
def test_relay_trees_equal_the_rule_and_are_valid(fanout):
    checked = relayed_nic = 0
    for plan in _plans():
        source, level = relay_sources(plan, fanout)
        want_s, want_l = _reference(plan, fanout)
        assert source.tolist() == want_s and level.tolist() == want_l, plan.policy
        R, N, d = plan.num_ranks, plan.num_slots, plan.topology.ranks_per_domain
        holds = {}  # (expert, rank) -> level of that copy (the home: 0)
        for r in range(R):
            for n in range(N):
                e = int(plan.slot_expert[r, n])
                if e >= 0:
                    holds[(e, r)] = int(level[r, n])
        for e in range(plan.num_experts):
            holds[(e, int(plan.main_rank[e]))] = 0
        crossings, children = {}, {}
        for r in range(R):
            for n in range(N):
                e, s, lv = int(plan.slot_expert[r, n]), int(source[r, n]), int(level[r, n])
                if e < 0:
                    assert (s, lv) == (-1, 0)
                    continue
                assert (e, s) in holds and holds[(e, s)] == lv - 1 and s != r  # a copy that arrived a level before
                link = "nic" if s // d != r // d else "nvlink"
                if link == "nic":
                    crossings[(e, r // d)] = crossings.get((e, r // d), 0) + 1
                    relayed_nic += s != int(plan.main_rank[e])
                children[(e, s, link)] = children.get((e, s, link), 0) + 1
        assert all(c == 1 for c in crossings.values())  # one NIC crossing per (expert, remote domain)
        assert all(c <= fanout for c in children.values())  # per node at most fanout over NVLink and over the NIC
        checked += 1
    assert checked == 32
    assert relayed_nic > 0 or fanout > 2  # some remote root fetched from another domain's root


@pytest.mark.parametrize("fanout", [1, 2, 3])
def test_a_copy_on_its_home_rank_is_no_node_of_a_tree(fanout):
    """The capacity step may give an expert's home rank a slot holding that expert. That copy is made within the rank
    (level 1, from itself) and is left out of the trees, so a tree never outgrows max_level (the levels a runtime
    runs) even where every rank of the home's domain holds the expert: a chain of the three other ranks at fanout 1."""
    from topoep.relay import direct_beyond_tree, relay_fetch_fs, relay_levels

    topo = Topology(num_domains=1, ranks_per_domain=4)
    base = solve(torch.ones(4, 4, dtype=torch.int64), topo, num_slots=1, policy="static", backend="reference",
                 expert_bytes=1000, token_bytes=10)
    plan = dataclasses.replace(base, slot_expert=torch.tensor([[0], [0], [0], [0]]))  # rank 0 is expert 0's home
    source, level = relay_sources(plan, fanout)
    assert (int(source[0, 0]), int(level[0, 0])) == (0, 1)
    assert source.tolist() == _reference(plan, fanout)[0] and level.tolist() == _reference(plan, fanout)[1]
    assert int(level.max()) <= max_level(topo, fanout) == {1: 3, 2: 2, 3: 1}[fanout]
    assert int(relay_levels(plan, source, level, max_level(topo, fanout)).sum()) == 4  # every copy in some level
    relay_fetch_fs(plan, fanout, topo)  # no level beyond max_level
    assert bool(direct_beyond_tree(plan, fanout)) == (3 > fanout)  # the home sends 3 copies over NVLink directly


def test_levels_partition_the_fetch_and_a_wide_fanout_is_the_direct_fetch():
    for plan in _plans():
        source, level = relay_sources(plan, 2)
        per_level = relay_levels(plan, source, level)
        assert int(per_level.sum()) == int((plan.slot_expert >= 0).sum())
        if plan.topology.num_domains == 1:  # one domain, every copy a child of its home: the unrelayed fetch
            wide = relay_levels(plan, *relay_sources(plan, plan.num_ranks * plan.num_slots))
            assert wide.shape[0] == 1 and torch.equal(wide[0], links.replica_matrix(plan))


def test_a_hot_expert_home_sends_a_tree_share():
    """Every rank wants expert 0 (1 slot each, 4 domains of 4): without relays its home sends every copy; with trees
    of 2 it sends 2 over NVLink and 2 over its NIC (the third remote domain's root fetches from another root)."""
    topo = Topology(num_domains=4, ranks_per_domain=4)
    R, E = 16, 32
    omega = torch.ones(R, E, dtype=torch.int64)
    omega[:, 0] = 500
    plan = solve(omega, topo, num_slots=1, policy="topoep_plus", expert_bytes=1000, token_bytes=1)
    copies = int((plan.slot_expert == 0).sum())
    assert copies >= 8
    assert int(links.replica_matrix(plan)[0].sum()) == copies  # direct: every copy from the home
    source, level = relay_sources(plan, 2)
    sends = torch.bincount(source[source >= 0], minlength=R)
    assert int(sends[0]) <= 2 + 2 and int(sends.max()) <= 2 + 2
    assert int(level.max()) >= 3  # the NIC tree's second level, then NVLink below it


def test_the_executed_trees_follow_the_guards_choice():
    """executed_sources: the relay trees by default and where the guard chose them (plan.info["relay"] True); the
    direct fetch in the trees' form (every copy from its home, level 1) where it chose that; every level within
    max_level."""
    from topoep.runtime.guard import NetBenefitGuard

    for plan in _plans():
        trees = relay_sources(plan, 2)
        occ = plan.slot_expert >= 0
        home = torch.where(occ, plan.main_rank[plan.slot_expert.clamp(min=0)], -1)
        for use, want in ((None, trees), (True, trees), (False, (home, occ.to(torch.int64)))):
            if use is not None:
                plan.info["relay"] = torch.tensor(use)
            got = relay_trees(plan, 2)
            assert torch.equal(got.source, want[0]) and torch.equal(got.level, want[1])
            assert int(got.level.max()) <= got.levels == max_level(plan.topology, 2)
        plan.info.pop("relay")
        executed = NetBenefitGuard(relay_fanout=2).select(plan, 1e-6, 1)[0]
        assert executed.info["relay"].dtype == torch.bool and executed.info["relay"].shape == ()
        assert "relay" not in NetBenefitGuard().select(plan, 1e-6, 1)[0].info


def test_heap_depth_equals_walking_up_the_heap():
    from topoep.relay import _heap_depth

    def walk(i, f):
        d = 0
        while i > 0:
            i, d = (i - 1) // f, d + 1
        return d

    idx = torch.arange(300)
    for f in (1, 2, 3, 7, 64, 1000):
        assert _heap_depth(idx, f, 300 if f == 1 else 12).tolist() == [walk(i, f) for i in range(300)], f


def test_bad_fanout():
    plan = next(iter(_plans()))
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="fanout must be an integer >= 1"):
            relay_sources(plan, bad)


def test_the_simulator_relays_a_hot_experts_copies():
    """The hot expert of test_a_hot_expert_home_sends_a_tree_share on the paper's cluster: the relayed fetch takes
    less time than every copy from the home, and the simulated layer is faster with it."""
    import dataclasses

    from topoep_research import sim

    cl, model = sim.CLUSTERS["paper_h800"], sim.MODELS["qwen3"].with_experts(256)
    omega = torch.full((32, 256), 30, dtype=torch.int64)
    omega[:, 0] = 3000
    direct = sim.simulate(omega, cl, model=model, policy="topoep_plus", num_slots=1)
    ex = dataclasses.replace(sim.EXECUTIONS["topoep"], relay_fanout=2)
    relayed = sim.simulate(omega, cl, model=model, policy="topoep_plus", num_slots=1, execution=ex)
    assert relayed.terms["fetch"] < direct.terms["fetch"] and relayed.layer_s < direct.layer_s
    with pytest.raises(ValueError, match="relay_fanout"):
        dataclasses.replace(ex, relay_fanout=0)


@pytest.mark.parametrize("fanout", [None, 2])
def test_sender_copies_equal_a_count_and_relays_bound_them(fanout):
    """topoep.relay.sender_copies against a count copy by copy; with relay trees a rank sends at most `fanout` copies
    of one expert over NVLink and at most `fanout` over its NIC."""
    from topoep.relay import sender_copies

    over = 0
    for plan in _plans():
        source = relay_sources(plan, fanout)[0] if fanout else None
        got = sender_copies(plan, source)
        R, N, d, M = plan.num_ranks, plan.num_slots, plan.topology.ranks_per_domain, plan.topology.num_domains
        count = {}
        for r in range(R):
            for n in range(N):
                e = int(plan.slot_expert[r, n])
                if e < 0:
                    continue
                s = int(source[r, n]) if fanout else int(plan.main_rank[e])
                link = "nic" if s // d != r // d else "nvlink"
                for key in ((link, s), (f"{link}_expert", s, e)):
                    count[key] = count.get(key, 0) + 1
        for name in ("nvlink", "nic", "nvlink_expert", "nic_expert"):
            want = max((v for k, v in count.items() if k[0] == name), default=0)
            assert got[name] == want, (plan.policy, name, got, want)
        if fanout:
            assert got["nvlink_expert"] <= fanout and got["nic_expert"] <= fanout, (plan.policy, got)
            direct = sender_copies(plan)
            over += direct["nvlink_expert"] > fanout or direct["nic_expert"] > fanout
    assert fanout is None or over > 0  # without relays some rank sends more: the bound above is not vacuous


def test_relay_steps_overlap_the_levels_chunk_by_chunk():
    """relay_steps: step s holds every level l whose chunk s - (l - 1) exists (step_chunk), so each level's copies
    appear in `chunks` consecutive steps starting at step l - 1; one chunk is the levels themselves. chunk_range
    tiles a copy's elements."""
    from topoep.relay import check_chunks, chunk_range, relay_steps, step_chunk

    flows = torch.randint(0, 3, (3, 4, 4))
    assert torch.equal(relay_steps(flows, 1), flows)
    for C in (2, 3, 5):
        steps = relay_steps(flows, C)
        assert steps.shape == (3 + C - 1, 4, 4)
        for s in range(3 + C - 1):
            want = sum((flows[lv - 1] for lv in (1, 2, 3) if step_chunk(s, lv, C) is not None),
                       torch.zeros(4, 4, dtype=flows.dtype))
            assert torch.equal(steps[s], want)
        assert torch.equal(steps.sum(0), C * flows.sum(0))  # every level's copies in C steps
        for lv in (1, 2, 3):
            assert [s for s in range(3 + C - 1) if step_chunk(s, lv, C) is not None] == list(range(lv - 1, lv - 1 + C))
    for n, C in ((10, 3), (12, 4), (2, 5), (7, 1)):
        ranges = [chunk_range(n, C, c) for c in range(C)]
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])) and all(lo <= hi for lo, hi in ranges)
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="chunks must be an integer >= 1"):
            check_chunks(bad)


def test_relay_fetch_fs_prices_each_step_at_its_busiest_link():
    """relay_fetch_fs: one chunk sums the levels' busiest links (transfer_fs per level); C chunks sum the steps'
    busiest links of everything each step carries, divided by C; the steps that carry a copy are counted. Over
    these plans the chunked fetch is never slower than the level-by-level one plus the extra steps' share."""
    from topoep.links import transfer_fs
    from topoep.relay import relay_fetch_fs, relay_steps

    for plan in _plans():
        topo = plan.topology
        flows = relay_levels(plan, *relay_sources(plan, 2), max_level(topo, 2))
        per_level = transfer_fs(flows, plan.expert_bytes, topo)
        fs1, steps1 = relay_fetch_fs(plan, 2, topo)
        assert int(fs1) == int(per_level.sum()) and int(steps1) == int((flows.sum((1, 2)) > 0).sum())
        for C in (2, 4):
            fs, steps = relay_fetch_fs(plan, 2, topo, C)
            by_step = transfer_fs(relay_steps(flows, C), plan.expert_bytes, topo)
            assert int(fs) == int(by_step.sum()) // C
            used = int(steps1)
            assert int(steps) == (used + C - 1 if used else 0)
            # a step's busiest link is at most the sum of its levels' (each level in C steps): never above
            assert int(fs) <= int(per_level.sum())


def test_direct_beyond_tree_equals_a_count_per_home():
    """direct_beyond_tree: True exactly when, fetching every copy from its home, some home sends more than `fanout`
    copies of one expert into its own domain or more than `fanout` over its NIC (into the other domains together)."""
    from topoep.relay import direct_beyond_tree

    seen = set()
    for plan in _plans():
        d = plan.topology.ranks_per_domain
        for fanout in (1, 2, 3):
            into = {}  # copies each home sends into each domain (a copy on the home rank crosses no link)
            for r in range(plan.num_ranks):
                for n in range(plan.num_slots):
                    e = int(plan.slot_expert[r, n])
                    if e >= 0 and r != int(plan.main_rank[e]):
                        into[(e, r // d)] = into.get((e, r // d), 0) + 1
            nic = {}  # copies each home sends over its NIC
            for (e, dom), n in into.items():
                if dom != int(plan.main_rank[e]) // d:
                    nic[e] = nic.get(e, 0) + n
            want = (any(n > fanout for (e, dom), n in into.items() if dom == int(plan.main_rank[e]) // d)
                    or any(n > fanout for n in nic.values()))
            got = direct_beyond_tree(plan, fanout)
            assert got.dtype == torch.bool and got.shape == () and bool(got) == want
            seen.add(want)
    assert seen == {False, True}


def _chain_reference(plan, source, level, hop):
    """copy_arrival written as a walk: parents (lower levels) first, each copy one hop after its source holds e."""
    R, N = plan.num_ranks, plan.num_slots
    se, src, lvl = plan.slot_expert.tolist(), source.tolist(), level.tolist()
    ready, out = {}, [[0] * N for _ in range(R)]
    for r, n in sorted(((r, n) for r in range(R) for n in range(N) if se[r][n] >= 0), key=lambda t: lvl[t[0]][t[1]]):
        s, e = src[r][n], se[r][n]
        ready[(r, e)] = ready.get((s, e), 0) + (int(hop[s, r]) if s != r else 0)
        out[r][n] = ready[(r, e)]
    return out


@pytest.mark.parametrize("fanout", [1, 2, 3])
def test_copy_arrival_and_async_fetch_fs_equal_a_walk(fanout):
    """copy_arrival: each copy arrives the sum of its path's hops after the start (a plain walk of the trees);
    async_fetch_fs: the longer of the whole fetch's busiest link and the latest arrival, in exact integers, never
    above the level-by-level price (each hop of a chain is at most its level's busiest link, and the busiest link of
    the sum at most the sum of the levels'), with the levels that carry a copy as its steps."""
    from topoep.links import transfer_fs
    from topoep.relay import async_fetch_fs, copy_arrival, relay_fetch_fs

    deep = 0
    for plan in _plans():
        topo = plan.topology.on("cpu")
        source, level = relay_sources(plan, fanout)
        hop = topo.cost_fs * plan.expert_bytes
        L = max_level(plan.topology, fanout)
        got = copy_arrival(plan, source, level, hop, L)
        assert got.dtype == torch.int64 and got.tolist() == _chain_reference(plan, source, level, hop)
        assert torch.equal(got, copy_arrival(plan, source, level, hop))  # the host-read number of levels
        flows = relay_levels(plan, source, level, L)
        fs, steps = async_fetch_fs(plan, fanout, plan.topology)
        want = max(int(transfer_fs(flows.sum(0), plan.expert_bytes, topo)), int(got.max()))
        assert int(fs) == want and int(steps) == int((flows.sum((1, 2)) > 0).sum())
        assert int(fs) <= int(relay_fetch_fs(plan, fanout, plan.topology)[0])
        deep += int(level.max()) >= 2
    assert deep > 0  # chains of relayed hops were walked


def test_async_fetch_fs_on_a_hand_built_tree():
    """Expert 0 (home 0) with copies on ranks 1, 2, 3 (domain 0) and 4, 5, 6, 7 (domain 1), fanout 2: domain 0's copies
    come from the home (1, 2) and from 1 (3), domain 1's root 4 from the home over the NIC, 5 and 6 from 4, 7 from 5.
    The longest chain is NIC + 2 NVLink hops; the busiest link is the home's NVLink port (2 copies) and the NICs
    (1 copy); copy by copy the fetch takes the chain, level by level the sum of three levels' busiest links."""
    from topoep.relay import async_fetch_fs, copy_arrival, relay_fetch_fs

    W, intra, inter = 1000, 2, 9  # femtoseconds per byte on NVLink and across
    topo = Topology(num_domains=2, ranks_per_domain=4, intra_cost=intra * 1e-15, inter_cost=inter * 1e-15)
    base = solve(biased_routing(8, 8, 64, 2, -4.0, seed=0), topo, num_slots=1, policy="static", expert_bytes=W,
                 token_bytes=10)
    se = torch.tensor([[-1], [0], [0], [0], [0], [0], [0], [0]])
    plan = dataclasses.replace(base, slot_expert=se)
    source, level = relay_sources(plan, 2)
    assert source.flatten().tolist() == [-1, 0, 0, 1, 0, 4, 4, 5]
    arrival = copy_arrival(plan, source, level, topo.cost_fs * W).flatten().tolist()
    assert arrival == [0, 2 * W, 2 * W, 4 * W, 9 * W, 11 * W, 11 * W, 13 * W]
    fs, steps = async_fetch_fs(plan, 2, topo)
    # busiest link over the fetch: home 0 sends 2 copies over NVLink (4 W) and 1 over the NIC (9 W); 4 sends 2 (4 W)
    assert int(fs) == 13 * W and int(steps) == 3
    # level by level: level 1 (home's NIC copy, 9 W), level 2 (two NVLink copies from 4, 4 W), level 3 (2 W)
    assert int(relay_fetch_fs(plan, 2, topo)[0]) == (9 + 4 + 2) * W


def duty_plan():
    """A plan whose relay trees differ between slot order and duty order (test_relays_are_drawn_...)."""
    topo = Topology(num_domains=1, ranks_per_domain=4)
    base = solve(biased_routing(4, 8, 64, 2, -4.0, seed=0), topo, num_slots=2, policy="static", expert_bytes=1000,
                 token_bytes=10)
    return dataclasses.replace(base, slot_expert=torch.tensor([[2, -1], [0, -1], [0, 2], [0, 2]]))


def test_relays_are_drawn_from_the_ranks_with_the_least_duty():
    """One domain of 4 ranks (2 experts each), fanout 2: expert 0 (home 0) has copies on ranks 1, 2, 3 and expert 2
    (home 1) on ranks 0, 2, 3, so ranks 0 and 1 each feed a tree of their own (duty 1) and ranks 2 and 3 none. Expert
    0's third copy is relayed by rank 2 (duty 0), not by rank 1 (the first in slot order, which feeds expert 2's
    tree); expert 2's by rank 2 too (its list: ranks 2, 3, then 0)."""
    from topoep.relay import relay_duty

    plan = duty_plan()
    assert relay_duty(plan).tolist() == [1, 1, 0, 0]
    source, level = relay_sources(plan, 2)
    assert source.tolist() == [[2, -1], [2, -1], [0, 1], [0, 1]]
    assert level.tolist() == [[2, 0], [2, 0], [1, 1], [1, 1]]


def _async_return(plan, fanout):
    """The copy-by-copy gradient return (`_push_grads_async_kernel`) walked on the host from the tables of
    `async_return_tables`: a slot sends once every child in its table has sent to it, the sum of its own gradient and
    what they sent; returns (the slots that never send, {expert: the slots whose gradients its home adds}), the home
    adding the regions of the level-1 copies fetched from it (`reduce_grads`)."""
    from collections import Counter

    from topoep.runtime.symm import async_return_tables

    R, N = plan.num_ranks, plan.num_slots
    se = plan.slot_expert.reshape(-1)
    source, level = (t.reshape(-1) for t in relay_sources(plan, fanout))
    levels = max(int(level.max()), 1)
    children = {}
    for me in range(R):
        items, count, table = async_return_tables(se, source, level, levels, me, N, fanout)
        for t in range(N):
            children[me * N + t] = [int(c) for c in table[t] if c >= 0]
    sent, changed = {}, True
    occupied = [g for g in range(R * N) if se[g] >= 0]
    while changed:
        changed = False
        for g in occupied:
            if g not in sent and all(c in sent for c in children[g]):
                sent[g] = Counter([g]) + sum((sent[c] for c in children[g]), Counter())
                changed = True
    stuck = [g for g in occupied if g not in sent]
    home = {}
    for g in occupied:
        e = int(se[g])
        if int(level[g]) == 1 and int(source[g]) == int(plan.main_rank[e]) and g in sent:
            home[e] = home.get(e, Counter()) + sent[g]
    return stuck, home


def nic_relays(plan, source) -> int:
    """Copies that crossed the NIC from another domain's first copy, not from their home (the NIC tree's deeper
    levels), where the slots fetch from `source` (int64[R, N])."""
    se = plan.slot_expert.cpu()
    home = plan.main_rank.cpu()[se.clamp(min=0)]
    d = plan.topology.ranks_per_domain
    dst = torch.arange(plan.num_ranks)[:, None] // d
    return int(((se >= 0) & (source.cpu() // d != dst) & (source.cpu() != home)).sum())


def copies_at_home(plan) -> torch.Tensor:
    """bool [R, N]: the slots holding a copy of an expert on that expert's own home rank (the capacity step's)."""
    home = plan.main_rank[plan.slot_expert.clamp(min=0)]
    return (plan.slot_expert >= 0) & (home == torch.arange(plan.num_ranks)[:, None])


def _self_copy_plans():
    """Plans whose slots hold copies on their experts' home ranks (the capacity step's), among other copies: the
    slot table of a 4-layer test at EP 8 (2 domains of 4, 8 experts per rank, the hot ones on rank 0) and random
    tables."""
    topo = Topology(num_domains=2, ranks_per_domain=4)
    base = solve(torch.ones(8, 64, dtype=torch.int64), topo, num_slots=2, policy="static", backend="reference",
                 expert_bytes=1000, token_bytes=10)
    yield dataclasses.replace(base, slot_expert=torch.tensor([[6, 3], [6, 1], [4, 0], [1, 3], [5, 7], [5, 2], [7, 4],
                                                              [2, 7]]))
    g = torch.Generator().manual_seed(3)
    for (M, d, e_loc, N), _ in itertools.product([(2, 4, 2, 2), (1, 6, 1, 3), (3, 2, 2, 2)], range(4)):
        topo = Topology(num_domains=M, ranks_per_domain=d)
        R = M * d
        base = solve(torch.ones(R, R * e_loc, dtype=torch.int64), topo, num_slots=N, policy="static",
                     backend="reference", expert_bytes=1000, token_bytes=10)
        hot = torch.randperm(R * e_loc, generator=g)[:3]  # a few hot experts, in every rank's slots, homes included
        se = torch.full((R, N), -1, dtype=torch.int64)
        for r in range(R):
            picks = [int(e) for e in hot[torch.randperm(3, generator=g)[:N]]]
            se[r, :len(picks)] = torch.tensor(picks)
        yield dataclasses.replace(base, slot_expert=se)


@pytest.mark.parametrize("fanout", [1, 2, 3])
def test_the_copy_by_copy_return_sums_every_copy_once_and_never_waits_on_itself(fanout):
    """`async_return_tables` gives each slot the copies fetched from it one level deeper (the level-by-level return's
    children), never the slot itself, and a copy on its expert's home rank none: otherwise that slot waits for its
    own flag (the return hangs) and the home adds its direct copies twice. Walked on the host, every slot sends and
    each expert's home adds every copy of it exactly once."""
    from collections import Counter

    from topoep.runtime.symm import async_return_tables

    plans = list(_self_copy_plans()) + list(_plans())
    assert any(bool(copies_at_home(p).any()) for p in plans)
    for plan in plans:
        R, N = plan.num_ranks, plan.num_slots
        se = plan.slot_expert.reshape(-1)
        source, level = (t.reshape(-1) for t in relay_sources(plan, fanout))
        for me in range(R):
            table = async_return_tables(se, source, level, max(int(level.max()), 1), me, N, fanout)[2]
            for t in range(N):
                g = me * N + t
                want = [s for s in range(R * N) if se[g] >= 0 and int(se[s]) == int(se[g]) and int(source[s]) == me
                        and int(level[s]) == int(level[g]) + 1]
                assert [int(c) for c in table[t] if c >= 0] == want and len(want) <= max_children(fanout), (me, t)
                assert g not in table[t].tolist()
        stuck, home = _async_return(plan, fanout)
        assert stuck == []
        for e in {int(x) for x in se if x >= 0}:
            assert home[e] == Counter(s for s in range(R * N) if int(se[s]) == e), (e, home.get(e))
