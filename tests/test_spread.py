"""`topoep_plus_spread` (topoep.planners.spread): its objective recomputed by brute force from the plan, the rollback
to the best prefix checked against every prefix, and the warm-domain case it exists for (the contract, C1-C5 and
determinism, is checked for every policy in test_planner_properties.py)."""

import pytest
import torch

from topoep import Topology, solve, workloads
from topoep.planners.common import two_level_costs
from topoep.plan import default_main_rank
from topoep.planners.spread import (INGRESS_TRANSFERS, REPLICA_TRANSFERS, TOKEN_TRANSFERS, _State,
                                    solve_topoep_plus_spread)
from topoep.topology import FEMTO

W, S, T_FFN = 9_437_184, 4096, 45e-9


def _plan(om, topo, slots, max_moves=None, trees=False, move_cost_fs=None):
    if max_moves is None and move_cost_fs is None:
        return solve(om, topo, num_slots=slots, policy="topoep_plus_spread_tree" if trees else "topoep_plus_spread",
                     expert_bytes=W, token_bytes=S, t_ffn=T_FFN, backend="reference")
    return solve_topoep_plus_spread(om, topo, num_slots=slots, main_rank=default_main_rank(om.shape[1], om.shape[0]),
                                    expert_bytes=W, token_bytes=S, t_ffn=T_FFN, max_moves=max_moves, trees=trees,
                                    move_cost_fs=move_cost_fs)


def _objective(plan) -> int:
    """The planner's objective recomputed from the plan: t L_max, the replica term counted copy by copy from the slot
    table (each replica fetched from its expert's main rank; a rank's NIC counts copies sent and received), and the
    token term from the instances' loads per domain and per rank."""
    topo = plan.topology
    a, b, _ = two_level_costs(topo)
    R = plan.num_ranks
    nic_out, nic_in, nvl_out, nvl_in = ([0] * R for _ in range(4))
    for r in range(R):
        for e in plan.slot_expert[r].tolist():
            if e < 0:
                continue
            home = int(plan.main_rank[e])
            if int(topo.domain_of[home]) != int(topo.domain_of[r]):
                nic_out[home] += 1
                nic_in[r] += 1
            else:
                nvl_out[home] += 1
                nvl_in[r] += 1
    t = int(round(T_FFN * FEMTO))
    rep = REPLICA_TRANSFERS * W * max(b * max(nic_out + nic_in), a * max(nvl_out + nvl_in))
    # token term: per domain, its sources' demand against its instances' load, expert by expert
    rpd = topo.ranks_per_domain
    demand = plan.omega.view(topo.num_domains, rpd, -1).sum(1)  # [M, E]
    dom = topo.domain_of[plan.instance_rank]
    held = torch.zeros_like(demand)
    for p in range(plan.num_instances):
        if int(plan.instance_expert[p]) >= 0:
            held[dom[p], plan.instance_expert[p]] += plan.instance_load[p]
    busiest = int(torch.maximum((demand - held).clamp(min=0).sum(1), (held - demand).clamp(min=0).sum(1)).max())
    # and each rank's share of its domain's inflow: instance by instance, in proportion to its load
    xin = [0] * R
    for p in range(plan.num_instances):
        e = int(plan.instance_expert[p])
        if e < 0:
            continue
        d, u = int(dom[p]), int(plan.instance_load[p])
        xin[int(plan.instance_rank[p])] += _share(u, int(held[d, e]), int(demand[d, e]))
    tok = max(TOKEN_TRANSFERS * S * b * busiest // rpd, INGRESS_TRANSFERS * S * b * max(xin))
    return t * int(plan.rank_load.max()) + rep + tok


def _share(u: int, held: int, demand: int) -> int:
    """An instance's share of its domain's inflow for its expert: its load u of the domain's `held`, `demand`."""
    return u * max(held - demand, 0) // held if held > 0 else 0


def test_ingress_shares_follow_every_move():
    """The greedy's per-rank inflow shares (kept move by move) equal a recount from its loads after random moves,
    also on the ranks a move does not touch (another instance of the moved expert in the same domain)."""
    import random

    rng = random.Random(3)
    for seed in range(5):
        R, rpd, N = 8, 4, 2
        om = workloads.scenario("natural", R, 4 * R, 256, 4, ranks_per_domain=rpd, seed=seed).tolist()
        mr = default_main_rank(4 * R, R).tolist()
        st = _State(om, mr, N, rpd)
        for _ in range(40):
            rb = rng.randrange(R)
            held = [e for e, u in st.U[rb].items() if u > 0]
            if not held:
                continue
            e, rt = rng.choice(held), rng.randrange(R)
            if rt == rb or (e not in st.U[rt] and st.used[rt] == N):
                continue
            st.apply(rb, rt, e, rng.randint(1, st.U[rb][e]), mr[e])
            recount = [sum(_share(u, st.Ud[r // rpd][x], st.D[r // rpd][x]) for x, u in st.U[r].items())
                       for r in range(R)]
            assert st.xin == recount


CASES = [("warm_domain", 32, 8, 1), ("hot_rank", 16, 4, 2), ("natural", 16, 8, 2), ("source_ragged", 16, 4, 1),
         ("uniform", 8, 4, 2), ("zero_load", 8, 2, 3), ("hot_domain", 16, 4, 4), ("warm_domain", 16, 2, 4)]


@pytest.mark.parametrize("scenario,R,rpd,slots", CASES)
def test_objective_is_the_plans_and_never_above_static(scenario, R, rpd, slots):
    om = workloads.scenario(scenario, R, 8 * R, 512, 8, ranks_per_domain=rpd, seed=1)
    topo = Topology(num_domains=R // rpd, ranks_per_domain=rpd)
    plan = _plan(om, topo, slots)
    plan.check(c4=True)
    static = solve(om, topo, num_slots=slots, policy="static", expert_bytes=W, token_bytes=S)
    assert plan.info["static_objective_fs"] == _objective(static)
    # the kept prefix's objective is the plan's, counted copy by copy (dropped load-free replicas only lower it)
    if plan.info["dropped"] == 0:
        assert _objective(plan) == plan.info["objective_fs"]
    assert _objective(plan) <= plan.info["objective_fs"] <= plan.info["static_objective_fs"]
    assert plan.info["moves"] <= plan.info["greedy_moves"]


@pytest.mark.parametrize("trees", [False, True])
@pytest.mark.parametrize("scenario,R,rpd,slots", CASES[:4])
def test_rollback_keeps_the_first_best_prefix(scenario, R, rpd, slots, trees):
    """Planning with max_moves=k stops the greedy after k moves and rolls back within them: its objective is the
    best of the first k prefixes. So the full plan's objective is the minimum over every k, reached first at its
    kept length; never above static's. With the trees' pricing (topoep_plus_spread_tree) too."""
    om = workloads.scenario(scenario, R, 8 * R, 512, 8, ranks_per_domain=rpd, seed=2)
    topo = Topology(num_domains=R // rpd, ranks_per_domain=rpd)
    full = _plan(om, topo, slots, trees=trees)
    assert full.policy == ("topoep_plus_spread_tree" if trees else "topoep_plus_spread")
    assert full.info["objective_fs"] <= full.info["static_objective_fs"]
    objs = []
    for k in range(full.info["greedy_moves"] + 1):
        p = _plan(om, topo, slots, max_moves=k, trees=trees)
        assert p.info["greedy_moves"] == k
        objs.append(p.info["objective_fs"])
    assert objs == sorted(objs, reverse=True)  # the best prefix of a longer run is at least as good
    assert full.info["objective_fs"] == objs[-1]
    kept = full.info["moves"]
    assert objs[kept] == objs[-1] and (kept == 0 or objs[kept - 1] > objs[-1])  # the first prefix reaching the best


@pytest.mark.parametrize("trees", [False, True])
def test_move_cost_stops_the_greedy_on_its_path(trees):
    """The greedy's stopping threshold (move_cost_fs, default MOVE_COST_US) only ends the chain of moves earlier: the
    default plan equals the plan of every move that gains anything (move_cost_fs=0) cut after as many moves, a move
    cost no move can pay leaves the static plan, and a negative one is refused. On the natural routing of 64 ranks the
    default greedy makes fewer moves than the unthresholded one (the tail of moves that each gain less than their own
    planning time)."""
    shorter = 0
    for scenario, R, rpd, slots in CASES[:4] + [("natural", 64, 8, 2)]:
        om = workloads.scenario(scenario, R, 8 * R, 4096, 8, ranks_per_domain=rpd, seed=2)
        topo = Topology(num_domains=R // rpd, ranks_per_domain=rpd)
        every = _plan(om, topo, slots, trees=trees, move_cost_fs=0)
        dflt = _plan(om, topo, slots, trees=trees)
        k = dflt.info["greedy_moves"]
        assert k <= every.info["greedy_moves"]
        shorter += k < every.info["greedy_moves"]
        cut = _plan(om, topo, slots, trees=trees, move_cost_fs=0, max_moves=k)
        assert cut.info == dflt.info
        assert torch.equal(cut.slot_expert, dflt.slot_expert) and torch.equal(cut.route, dflt.route)
        none = _plan(om, topo, slots, trees=trees, move_cost_fs=1 << 62)
        assert none.info["greedy_moves"] == 0 and bool((none.slot_expert < 0).all())
    assert shorter >= 1
    for bad in (-1, 2.5):
        with pytest.raises(ValueError, match="move_cost_fs must be an integer >= 0"):
            _plan(om, topo, slots, trees=trees, move_cost_fs=bad)


def test_warm_domain_spreads_load_and_copies_over_the_other_domains():
    """Every rank of domain 0 is overloaded: topoep's stage 1 copies the experts of the one rank with the largest
    demand into every other domain (all copies leave through that rank's NIC); the local variant cannot move load
    out of the domain. The spread plan has the lowest objective and the lowest L_max of every policy, with far fewer
    copies per sender than topoep."""
    R, rpd, slots = 32, 8, 1
    om = workloads.scenario("warm_domain", R, 8 * R, 4096, 8, ranks_per_domain=rpd, seed=0)
    topo = Topology(num_domains=R // rpd, ranks_per_domain=rpd)
    kw = dict(num_slots=slots, expert_bytes=W, token_bytes=S, backend="reference")
    plans = {p: solve(om, topo, policy=p, **kw) for p in ("static", "topoep", "topoep_plus_local", "deepseek", "flexmoe")}
    plans["spread"] = _plan(om, topo, slots)
    objective = {p: _objective(plan) for p, plan in plans.items()}
    assert objective["spread"] < min(v for p, v in objective.items() if p != "spread")
    lmax = {p: int(plan.rank_load.max()) for p, plan in plans.items()}
    assert lmax["spread"] < min(v for p, v in lmax.items() if p != "spread") and 2 * lmax["spread"] < lmax["static"]

    def busiest_sender(plan):
        homes = plan.main_rank[plan.slot_expert[plan.slot_expert >= 0]]
        return int(torch.bincount(homes, minlength=R).max()) if homes.numel() else 0

    assert busiest_sender(plans["spread"]) * 3 < busiest_sender(plans["topoep"])
    # load left domain 0: the other domains host copies of its experts, and only of its experts
    dom0 = plans["spread"].main_rank < rpd
    spilled = plans["spread"].slot_expert[rpd:]
    assert bool(dom0[spilled[spilled >= 0]].all()) and int((spilled >= 0).sum()) > 0


def test_trees_price_a_domains_later_copies_on_nvlink_from_its_first():
    """Under the trees' pricing the first copy of an expert in another domain crosses the NIC from its home; the
    domain's later copies fetch from that first copy over NVLink (the direct pricing: every copy from the home over
    the NIC)."""
    R, rpd, N = 8, 4, 2
    om = [[1] * 16 for _ in range(R)]
    mr = default_main_rank(16, R).tolist()
    for trees in (False, True):
        st = _State(om, mr, N, rpd, trees)
        e, home = 0, mr[0]  # expert 0 lives on rank 0 (domain 0)
        for rt in (5, 6, 7):  # three copies into domain 1, then one into the home's domain
            st.apply(home, rt, e, 1, home)
        st.apply(home, 1, e, 1, home)
        if trees:
            assert (st.nic_out[home], st.nic_in[5], st.nic_in[6]) == (1, 1, 0)
            assert (st.nvl_out[5], st.nvl_in[6], st.nvl_in[7], st.nvl_out[home]) == (2, 1, 1, 1)
        else:
            assert (st.nic_out[home], st.nic_in[5], st.nic_in[6], st.nvl_out[home]) == (3, 1, 1, 1)
            assert st.nvl_out[5] == 0


def test_a_larger_t_ffn_buys_more_copies():
    """The objective trades the straggler's compute against the busiest copy link: where compute is dearer the plan
    balances at least as far."""
    R, rpd = 16, 4
    om = workloads.scenario("hot_rank", R, 8 * R, 4096, 8, ranks_per_domain=rpd, seed=0)
    topo = Topology(num_domains=R // rpd, ranks_per_domain=rpd)
    kw = dict(num_slots=2, policy="topoep_plus_spread", expert_bytes=W, token_bytes=S, backend="reference")
    cheap, dear = solve(om, topo, t_ffn=1e-9, **kw), solve(om, topo, t_ffn=1e-6, **kw)
    assert int(dear.rank_load.max()) < int(cheap.rank_load.max())
    assert dear.num_replicas > cheap.num_replicas


def test_bad_t_ffn_is_refused():
    om = torch.ones(4, 8, dtype=torch.int64)
    with pytest.raises(ValueError, match="t_ffn must be a finite positive"):
        solve(om, Topology(num_domains=2, ranks_per_domain=2), policy="topoep_plus_spread", t_ffn=-1.0)


def test_the_simulated_layer_keeps_the_spread_candidate_where_it_is_faster():
    from topoep.runtime import NetBenefitGuard
    from topoep_research import sim

    cl = sim.CLUSTERS["paper_h800"]
    R = 32
    model = sim.MODELS["qwen3"].with_experts(8 * R)
    om = workloads.scenario("warm_domain", R, model.num_experts, 4096, model.top_k,
                            ranks_per_domain=cl.domain_size(R), seed=0)
    kw = dict(model=model, policy="topoep_plus", num_slots=1, guard=NetBenefitGuard())
    plain = sim.simulate(om, cl, **kw)
    spread = sim.simulate(om, cl, plus_candidates=("topoep_plus_local", "topoep_plus_spread"), **kw)
    flexmoe = sim.simulate(om, cl, **{**kw, "policy": "flexmoe"})
    assert spread.stats["guard_choice"] == 2 and spread.stats["local_plan"] == 0
    assert spread.layer_s < min(plain.layer_s, flexmoe.layer_s)


def test_the_relayed_layer_keeps_the_tree_candidate_where_it_is_faster():
    """A hot rank at EP 16 with relayed fetches: the candidate priced for the trees is kept and is faster than the
    directly priced one."""
    import dataclasses

    from topoep.runtime import NetBenefitGuard
    from topoep_research import sim

    cl = sim.CLUSTERS["paper_h800"]
    R = 16
    model = sim.MODELS["qwen3"].with_experts(8 * R)
    om = workloads.scenario("hot_rank", R, model.num_experts, 4096, model.top_k,
                            ranks_per_domain=cl.domain_size(R), seed=0)
    kw = dict(model=model, policy="topoep_plus", num_slots=2, guard=NetBenefitGuard(),
              execution=dataclasses.replace(sim.EXECUTIONS["topoep"], relay_fanout=2))
    direct = sim.simulate(om, cl, plus_candidates=("topoep_plus_local", "topoep_plus_spread"), **kw)
    tree = sim.simulate(om, cl, plus_candidates=("topoep_plus_local", "topoep_plus_spread",
                                                 "topoep_plus_spread_tree"), **kw)
    assert tree.stats["guard_choice"] == 3 and tree.layer_s < direct.layer_s


def test_the_multi_block_planner_refuses_the_spread_policies():
    """CudaPlanner.plan plans static, topoep and topoep_plus(_local) only; the spread policies have their own kernel
    (solve_spread_cuda), so it refuses them, and unknown names, before touching the device."""
    from topoep.planners.cuda import CudaPlanner

    planner = object.__new__(CudaPlanner)  # (no GPU here: the check comes before any device work)
    for policy in ("topoep_plus_spread", "topoep_plus_spread_tree", "deepseek"):
        with pytest.raises(ValueError, match=f"CudaPlanner plans static, topoep, topoep_plus, topoep_plus_local, not "
                                             f"'{policy}'"):
            planner.plan(None, None, policy, 1, 1, None, None)


def test_measured_latency_follows_the_moves():
    """The simulator's spread planner time for a call (measured_latency_s with moves): the measured latency at the
    measured workload's moves, MOVE_US more per further move, never below the fixed part; moves must be an integer."""
    from topoep.planners import spread

    for trees in (False, True):
        m = dict(spread.LATENCY_SET_MOVES if trees else spread.LATENCY_MOVES)[32]
        t = spread.measured_latency_s(32, trees)
        assert spread.measured_latency_s(32, trees, m) == pytest.approx(t)
        assert spread.measured_latency_s(32, trees, m + 10) == pytest.approx(t + 10 * dict(spread.MOVE_US)[32] * 1e-6)
        assert spread.measured_latency_s(32, trees, 0) == pytest.approx(
            max(dict(spread.FIXED_US)[32] * 1e-6, t - m * dict(spread.MOVE_US)[32] * 1e-6))
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="moves must be an integer"):
            spread.measured_latency_s(32, False, bad)


def test_solve_passes_the_move_cost_to_the_spread_planners_only():
    """topoep.solve's move_cost_fs reaches the spread planners (the same plan as the planner called with it) and is
    refused for any other policy and for a negative or non-integer value; the simulator asks for 0 where it times the
    spread planner as topoep_plus's (moves cost nothing more) and the measured default divided by spread_speedup."""
    from dataclasses import replace

    from topoep.planners.spread import default_move_cost_fs
    from topoep_research import sim

    om = workloads.scenario("natural", 32, 256, 4096, 8, ranks_per_domain=8, seed=2)
    topo = Topology(num_domains=4, ranks_per_domain=8)
    got = solve(om, topo, num_slots=2, policy="topoep_plus_spread", expert_bytes=W, token_bytes=S, t_ffn=T_FFN,
                backend="reference", move_cost_fs=0)
    assert got.info == _plan(om, topo, 2, move_cost_fs=0).info
    for policy, bad, match in (("topoep_plus", 0, "takes none"), ("topoep_plus_spread", -1, "integer >= 0"),
                               ("topoep_plus_spread", 1.5, "integer >= 0")):
        with pytest.raises(ValueError, match=match):
            solve(om, topo, num_slots=2, policy=policy, backend="reference", move_cost_fs=bad)
    ex = sim.EXECUTIONS["topoep"]
    assert sim.spread_move_cost_fs(ex) == 0
    assert sim.spread_move_cost_fs(replace(ex, spread_planner="measured")) == default_move_cost_fs()
    assert sim.spread_move_cost_fs(replace(ex, spread_planner="measured", spread_speedup=4.0)) == round(
        default_move_cost_fs() / 4)
