"""topoep.links, the per-link cost model: every rank's NVLink and NIC bytes per phase equal a brute-force count over
the plan's route and replicas on small random plans of every policy; a phase's time is its busiest link's; the
metrics carry the per-link terms; the simulator reads the same functions."""

import itertools

import pytest
import torch

from topoep import Plan, Topology, links, metrics, solve
from topoep.workloads import biased_routing

POLICIES = ("static", "topoep", "topoep_plus", "deepseek", "fastermoe", "flexmoe")


def _plans():
    for (M, d, e_loc, N), policy, seed in itertools.product([(2, 2, 3, 2), (3, 2, 2, 1), (2, 3, 2, 3), (1, 4, 2, 2)],
                                                           POLICIES, range(2)):
        topo = Topology(num_domains=M, ranks_per_domain=d, intra_cost=1e-3, inter_cost=4e-3)
        R = M * d
        omega = biased_routing(R, R * e_loc, 24, 2, -3.0, seed=seed)
        yield solve(omega, topo, num_slots=N, policy=policy, expert_bytes=1000, token_bytes=10)


def _brute(plan):
    """{phase: (nvl_out, nvl_in, nic_out, nic_in) as lists} by walking every route entry and replica."""
    R = plan.num_ranks
    dom = [r // plan.topology.ranks_per_domain for r in range(R)]
    inst_rank = plan.instance_rank.tolist()
    route = plan.route.tolist()
    out = {p: [[0.0] * R for _ in range(4)] for p in links.PHASES}

    def add(phase, s, r, nbytes):
        if s == r:
            return
        i = 0 if dom[s] == dom[r] else 2
        out[phase][i][s] += nbytes
        out[phase][i + 1][r] += nbytes

    for s in range(R):
        for p, n in enumerate(route[s]):
            if n:
                add("dispatch", s, inst_rank[p], n * plan.token_bytes)
                add("combine", inst_rank[p], s, n * plan.token_bytes)
    for r, row in enumerate(plan.slot_expert.tolist()):
        for e in row:
            if e >= 0:
                m = int(plan.main_rank[e])
                add("replica_fetch", m, r, plan.expert_bytes)
                add("grad_return", r, m, plan.expert_bytes)
    return out


def test_link_loads_equal_a_brute_force_count():
    checked = 0
    for plan in _plans():
        want = _brute(plan)
        for phase, loads in links.phase_loads(plan).items():
            got = [t.tolist() for t in (loads.nvl_out, loads.nvl_in, loads.nic_out, loads.nic_in)]
            assert got == want[phase], (plan.policy, phase)
        checked += 1
    assert checked == 48


def test_phase_time_is_the_busiest_link():
    """Two-level costs: the time of a phase is max(busiest NVLink bytes x intra_cost, busiest NIC bytes x
    inter_cost), counted by brute force; the stats name the largest fan-out of replica copies."""
    for plan in _plans():
        want = _brute(plan)
        stats = dict(zip(links.LINK_STAT_NAMES, links.link_stats(plan).tolist()))
        for phase, key in (("dispatch", "t_dispatch_link"), ("replica_fetch", "t_fetch_link")):
            nvl = max(max(a, b) for a, b in zip(want[phase][0], want[phase][1]))
            nic = max(max(a, b) for a, b in zip(want[phase][2], want[phase][3]))
            assert stats[key] == pytest.approx(max(nvl * 1e-3, nic * 4e-3), rel=1e-12)
        sends = [0] * plan.num_ranks
        for row in plan.slot_expert.tolist():
            for e in row:
                if e >= 0:
                    sends[int(plan.main_rank[e])] += 1
        assert stats["replica_max_sends"] == max(sends)
        assert stats["t_link_total"] == pytest.approx(4 * stats["t_dispatch_link"] + 3 * stats["t_fetch_link"])
        m = metrics(plan)
        assert all(m[k] == v for k, v in stats.items())


def test_transfer_fs_is_the_exact_busiest_link_of_a_brute_force_count():
    """transfer_fs (the guard's exact integer time) of a dispatch and a fetch equals the busiest link of the brute-force
    count at the integer per-byte costs, for the plan's costs and for costs that are no whole number of
    femtoseconds (then transfer_seconds agrees within the rounding of cost_fs); batched flows give one time each."""
    for plan in _plans():
        want = _brute(plan)
        for topo in (plan.topology, Topology(num_domains=plan.topology.num_domains,
                                             ranks_per_domain=plan.topology.ranks_per_domain, intra_cost=1 / 155e9,
                                             inter_cost=1 / 45e9)):
            a, b = (int(topo.cost_fs[0, 1 if topo.ranks_per_domain > 1 else 0]),
                    int(topo.cost_fs[0, -1]) if topo.num_domains > 1 else 0)
            counts = {"dispatch": (links.token_matrix(plan), plan.token_bytes),
                      "replica_fetch": (links.replica_matrix(plan), plan.expert_bytes)}
            for phase, (flows, unit) in counts.items():
                nvl = max(max(x, y) for x, y in zip(want[phase][0], want[phase][1]))
                nic = max(max(x, y) for x, y in zip(want[phase][2], want[phase][3]))
                got = links.transfer_fs(flows, unit, topo)
                assert got.dtype == torch.int64 and int(got) == max(int(nvl) * a, int(nic) * b), (plan.policy, phase)
                assert float(got) * 1e-15 == pytest.approx(
                    float(links.transfer_seconds(flows.double() * unit, topo)), rel=1e-4)
            both = torch.stack([counts["dispatch"][0], 2 * counts["dispatch"][0]])
            assert links.transfer_fs(both, plan.token_bytes, topo).tolist() == [
                int(links.transfer_fs(f, plan.token_bytes, topo)) for f in both]


def test_a_hot_rank_fan_out_is_its_busiest_link():
    """One expert wanted by every rank of 2 domains, 1 slot each: every replica copy leaves the home rank, whose
    port carries them all, while the eq. 7 sum spreads them over all transfers."""
    topo = Topology(num_domains=2, ranks_per_domain=4, intra_cost=1e-3, inter_cost=4e-3)
    R, E = 8, 16
    omega = torch.zeros(R, E, dtype=torch.int64)
    omega[:, 0] = 100
    omega[:, 1:] = 1
    plan = solve(omega, topo, num_slots=1, policy="topoep_plus", expert_bytes=1000, token_bytes=1)
    stats = dict(zip(links.LINK_STAT_NAMES, links.link_stats(plan).tolist()))
    n = int(links.replica_matrix(plan)[0].sum())
    assert n >= 2 and stats["replica_max_sends"] == n
    loads = links.phase_loads(plan)["replica_fetch"]
    assert loads.nvl_out[0] + loads.nic_out[0] == n * 1000  # every copy from rank 0


def test_the_simulator_reads_the_same_functions():
    from topoep_research import sim

    assert sim.token_matrix is links.token_matrix and sim.replica_matrix is links.replica_matrix
    plan = next(iter(_plans()))
    f = links.phase_flows(plan)["dispatch"]
    assert {k: v.tolist() for k, v in sim.link_loads(f, plan.topology.domain_of).items()} == \
        {k: v.tolist() for k, v in links.link_loads(f, plan.topology.domain_of).as_dict().items()}


def test_link_stats_read_no_tensor_values():
    """No host synchronisation (the guard runs these every call): every input on the meta device, where reading a
    value (a boolean mask's size, .item()) raises."""
    plan = next(iter(_plans()))
    meta = Plan(omega=plan.omega.to("meta"), topology=plan.topology, num_slots=plan.num_slots,
                main_rank=plan.main_rank.to("meta"), slot_expert=plan.slot_expert.to("meta"),
                route=plan.route.to("meta"), policy=plan.policy, expert_bytes=10, token_bytes=1)
    assert links.link_stats(meta).is_meta and links.replica_matrix(meta).is_meta


def test_dedup_counts_an_experts_instances_in_one_domain_as_one_choice():
    """DeepEP's NIC traffic depends on which domains a token reaches: copies of an expert inside its home domain
    (DeepSeek EPLB's placement) change none, so the NIC loads equal the static plan's. A token selects an expert once,
    so its instances in a domain exclude each other (their shares add; taken as independent, they read low)."""
    import dataclasses

    from topoep import Topology, solve, workloads
    from topoep.links import token_loads

    topo = Topology(num_domains=4, ranks_per_domain=4)
    omega = workloads.scenario("natural", 16, 64, 1024, 8, ranks_per_domain=4, seed=0)
    static = solve(omega, topo, num_slots=2, policy="static")
    local = solve(omega, topo, num_slots=2, policy="deepseek")  # every copy in its main's domain
    assert int((local.slot_expert >= 0).sum()) > 0
    home_dom = topo.domain_of[local.main_rank[local.slot_expert.clamp(min=0)]]
    assert bool(((home_dom == topo.domain_of[:, None]) | (local.slot_expert < 0)).all())
    a, b = token_loads(static, 8), token_loads(local, 8)
    torch.testing.assert_close(b.nic_out, a.nic_out, rtol=1e-12, atol=1e-6)
    torch.testing.assert_close(b.nic_in, a.nic_in, rtol=1e-12, atol=1e-6)
