"""Unit tests (CPU): topoep_research.sim, the cluster-scale cost simulator, on hand-made plans with known answers
(traffic accounting, busiest links, DeepEP-style deduplication), the two-stream schedule, presets,
config validation, workload sampling and the calibration's recovery of known constants."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from topoep import POLICIES, Topology, solve, workloads
from topoep.plan import Plan
from topoep_research import sim

REPO = Path(__file__).resolve().parent.parent

# A toy fabric with round numbers: NVLink 1000 B/s, RDMA 100 B/s, t_ffn = 18 * 5 * 50 / 4500 = 1 s.
TOY = sim.Cluster(name="toy", gpus_per_domain=2, nvlink_bytes_per_s=1000.0, nvlink_latency_s=0.0,
                  rdma_bytes_per_s=100.0, rdma_latency_s=0.0, gemm_flops_per_s=4500.0)
TOY_MODEL = sim.ModelShape(name="toy", hidden_size=5, ffn_hidden_size=50, num_experts=4, top_k=2, tokens_per_rank=4)
SERIAL = sim.Execution(name="serial", pipelined=False, num_chunks=1, reload_hidden=False, grad_return_hidden=False,
                       plan_s=0.5, dedup=False)
S, W = TOY_MODEL.token_bytes, TOY_MODEL.expert_bytes  # 10 and 1500 bytes


def toy_plans():
    """2 domains x 2 ranks, expert e on rank e. Source 0 sends 2 assignments to expert 0 (its own) and 6 to
    expert 2 (rank 2, the other domain). static: 6 rows cross the NIC 0 -> 2. replica: expert 2 is
    replicated on rank 1 (0's domain) and serves all 6, so tokens stay on NVLink and W crosses 2 -> 1."""
    topo = TOY.topology(4)
    om = torch.tensor([[2, 0, 6, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    static = solve(om, topo, num_slots=1, policy="static", expert_bytes=W, token_bytes=S)
    x = torch.zeros(4, 4, dtype=torch.bool)
    x[torch.arange(4), torch.arange(4)] = True
    x[2, 1] = True
    q = torch.zeros(4, 4, 4, dtype=torch.int64)
    q[0, 0, 0], q[0, 2, 1] = 2, 6
    rep = Plan.from_dense(x, q, om, topo, num_slots=1, expert_bytes=W, token_bytes=S).check()  # policy "dense"
    return static, rep


# -- traffic accounting ------------------------------------------------------------------------------
def test_token_and_replica_matrices_of_hand_made_plans():
    static, rep = toy_plans()
    assert sim.token_matrix(static).tolist() == [[2, 0, 6, 0], [0] * 4, [0] * 4, [0] * 4]
    assert sim.token_matrix(rep).tolist() == [[2, 6, 0, 0], [0] * 4, [0] * 4, [0] * 4]
    assert not sim.replica_matrix(static).any()
    B = sim.replica_matrix(rep)
    assert B[2, 1] == 1 and B.sum() == 1  # one W transfer main rank 2 -> slot rank 1


def test_link_loads_split_nvlink_and_nic_and_transfer_time_takes_the_busiest():
    static, rep = toy_plans()
    dom = static.topology.domain_of
    ls = sim.token_link_loads(static, S, 2, dedup=False)
    assert ls["nic_out"].tolist() == [60, 0, 0, 0] and ls["nic_in"].tolist() == [0, 0, 60, 0]
    assert ls["nvl_out"].sum() == 0  # own-rank rows (source 0 -> expert 0) cost nothing
    t, busy = sim.transfer_time(ls, TOY)
    assert t == pytest.approx(60 / 100) and busy["nic_rank"] in (0, 2) and busy["nic_bytes"] == 60
    lr = sim.token_link_loads(rep, S, 2, dedup=False)
    assert lr["nvl_out"].tolist() == [60, 0, 0, 0] and lr["nic_out"].sum() == 0
    assert sim.transfer_time(lr, TOY)[0] == pytest.approx(60 / 1000)
    lw = sim.link_loads(sim.replica_matrix(rep).double() * W, dom)
    assert lw["nic_out"].tolist() == [0, 0, 1500, 0] and lw["nic_in"].tolist() == [0, 1500, 0, 0]
    # latency: RDMA's when any byte crosses domains, NVLink's otherwise, none for an empty transfer
    lat = replace(TOY, nvlink_latency_s=1.0, rdma_latency_s=2.0)
    assert sim.transfer_time(ls, lat)[0] == pytest.approx(2.6)
    assert sim.transfer_time(lr, lat)[0] == pytest.approx(1.06)
    assert sim.transfer_time({k: v * 0 for k, v in ls.items()}, lat)[0] == 0.0


def test_replica_hotspot_on_the_main_rank():
    """One expert replicated on three ranks: its main rank sends 3 W (the busiest link), each slot gets W."""
    topo = Topology(num_domains=1, ranks_per_domain=4)
    om = torch.tensor([[8, 0, 0, 0]] * 4)
    x = torch.zeros(4, 4, dtype=torch.bool)
    x[torch.arange(4), torch.arange(4)] = True
    x[0, 1:] = True
    q = torch.zeros(4, 4, 4, dtype=torch.int64)
    for s in range(4):
        q[s, 0, s] = 8
    plan = Plan.from_dense(x, q, om, topo, num_slots=1, policy="flexmoe", expert_bytes=W, token_bytes=S).check()
    loads = sim.link_loads(sim.replica_matrix(plan).double() * W, topo.domain_of)
    assert loads["nvl_out"].tolist() == [3 * W, 0, 0, 0] and loads["nvl_in"].tolist() == [0, W, W, W]
    assert sim.token_link_loads(plan, S, 2, dedup=False)["nvl_out"].sum() == 0  # every source runs locally


@pytest.mark.parametrize("omega, nvl_out, nvl_in, nic_out, nic_in", [
    # 4 tokens of rank 0, each selecting experts 0 and 1 (top-2): 4 rows to rank 1 (its own expert 0 is free)
    ([[4, 4, 0, 0]], [4, 0, 0, 0], [0, 4, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]),
    # each token selects experts 2 and 3 (ranks 2, 3 of the other domain): it crosses the NIC once, into
    # rank 2 (rank 0's local index in domain 1), which forwards it to rank 3 over NVLink
    ([[0, 0, 4, 4]], [0, 0, 4, 0], [0, 0, 0, 4], [4, 0, 0, 0], [0, 0, 4, 0]),
    # 2 tokens select {1, 3}, 2 select {2, 3}: rank 1 gets 2 over NVLink; every token needs domain 1 (expert
    # 3), so 4 cross the NIC into rank 2, which forwards all 4 to rank 3 (and keeps the 2 for expert 2)
    ([[0, 2, 2, 4]], [2, 0, 4, 0], [0, 2, 0, 4], [4, 0, 0, 0], [0, 0, 4, 0]),
])
def test_dedup_counts_each_token_once_per_destination(omega, nvl_out, nvl_in, nic_out, nic_in):
    topo = TOY.topology(4)
    om = torch.tensor(omega + [[0, 0, 0, 0]] * 3)
    plan = solve(om, topo, num_slots=0, policy="static", expert_bytes=W, token_bytes=S)
    got = sim.token_link_loads(plan, 1.0, 2, dedup=True)
    for key, want in (("nvl_out", nvl_out), ("nvl_in", nvl_in), ("nic_out", nic_out), ("nic_in", nic_in)):
        assert got[key].tolist() == pytest.approx(want, abs=1e-6), key


def test_dedup_never_exceeds_per_assignment_rows():
    topo = Topology(num_domains=4, ranks_per_domain=4)
    om = workloads.biased_routing(16, 64, 256, 8, -2.0, seed=3)
    for policy in ("static", "topoep"):
        plan = solve(om, topo, num_slots=2, policy=policy)
        d, a = sim.token_link_loads(plan, 1.0, 8, True), sim.token_link_loads(plan, 1.0, 8, False)
        assert d["nic_out"].sum() <= a["nic_out"].sum() + 1e-6
        assert (d["nic_out"] <= a["nic_out"] + 1e-6).all()


# -- schedule ------------------------------------------------------------------------------------------
def test_two_stream_pipeline_hand_computed():
    # compute-bound: dispatch 2 hides under compute 1, combine 1 under compute 2; fill d1, drain c2
    assert sim.pipeline([1, 1], [3, 3], [1, 1]) == pytest.approx((8, 7))
    # communication-bound: compute hides entirely, the comm stream sets the time
    assert sim.pipeline([3, 3], [1, 1], [3, 3]) == pytest.approx((12, 7))
    # backward: compute waits for a reload (compute_ready), weight gradients after the chunks
    assert sim.pipeline([1, 1], [1, 1], [1, 1], compute_ready=5, tail_compute=4) == pytest.approx((8, 11))
    # one chunk: no overlap at all
    assert sim.pipeline([2], [3], [4]) == pytest.approx((9, 5))


def test_simulate_serial_matches_hand_computation():
    static, rep = toy_plans()
    r = sim.simulate(static, TOY, model=TOY_MODEL, execution=SERIAL)
    # 4 token transfers of 6 rows x 10 B over a 100 B/s NIC; straggler 6 assignments x 1 s; no planning
    assert r.layer_s == pytest.approx(4 * 0.6 + 6.0)
    assert r.exposed == pytest.approx({"plan": 0.0, "replica": 0.0, "compute": 6.0, "token": 2.4, "overhead": 0.0})
    r = sim.simulate(rep, TOY, model=TOY_MODEL, execution=SERIAL)
    # plan 0.5; fetch, reload, return: 1500 B over the NIC each (15 s); tokens 60 B over NVLink (0.06 s)
    assert r.layer_s == pytest.approx(0.5 + 3 * 15 + 4 * 0.06 + 6.0)
    assert r.forward_s == pytest.approx(0.5 + 15 + 2 * 0.06 + 2.0)
    assert r.exposed["replica"] == pytest.approx(45) and r.exposed["token"] == pytest.approx(0.24)
    assert r.traffic["replica_nic_bytes"] == W and r.traffic["replica_total_per_layer"] == 3 * W
    assert r.traffic["token_nvlink_bytes"] == 60 and r.traffic["token_total_per_layer"] == 240
    assert r.stats["num_replicas"] == 1 and r.stats["internode_fraction"] == 0


def test_simulate_pipelined_hides_what_the_paper_says():
    static, rep = toy_plans()
    pipe = replace(SERIAL, pipelined=True, num_chunks=2, reload_hidden=True, grad_return_hidden=True)
    r = sim.simulate(static, TOY, model=TOY_MODEL, execution=pipe)
    # chunks: transfers 0.3 s, forward compute 1 s: forward 2.6 s (fill 0.3, drain 0.3); backward: dgrads
    # 1 s each, weight gradients 2 s after them: compute stream ends at 4.3 s, after the last combine
    assert r.forward_s == pytest.approx(2.6) and r.backward_s == pytest.approx(4.3)
    assert r.layer_s == pytest.approx(6.9) and r.exposed["token"] == pytest.approx(0.9)
    assert r.layer_s < sim.simulate(static, TOY, model=TOY_MODEL, execution=SERIAL).layer_s
    # with reload and gradient return hidden only the forward fetch is exposed
    r = sim.simulate(rep, TOY, model=TOY_MODEL, execution=pipe)
    assert r.exposed["replica"] == pytest.approx(15)
    exposed_all = replace(pipe, reload_hidden=False, grad_return_hidden=False)
    r2 = sim.simulate(rep, TOY, model=TOY_MODEL, execution=exposed_all)
    assert r2.exposed["replica"] > 15 and r2.layer_s > r.layer_s


def test_fetch_overlap_hand_computed():
    """Execution.fetch_overlap on the toy replica plan: the fetch (15 s over the NIC, 2 -> 1) runs beside the
    dispatch (0.03 s per chunk over NVLink, 0 -> 1: no shared link, no stretch); every rank's slot rows wait for it.
    Rank 0 computes its 2 main assignments (1/3 s per chunk) before the fetch ends; rank 1's slot rows (1 s per chunk)
    start at 15 s: chunk ends 16 and 17 s, combines 16.03 and 17.03 s. Without it: 15 s, then the 2.06 s pipeline."""
    static, rep = toy_plans()
    pipe = replace(SERIAL, pipelined=True, num_chunks=2, reload_hidden=True, grad_return_hidden=True)
    over = replace(pipe, fetch_overlap=True)
    r0, r1 = (sim.simulate(rep, TOY, model=TOY_MODEL, execution=e) for e in (pipe, over))
    assert r0.forward_s == pytest.approx(0.5 + 15 + 2.06)
    assert r1.forward_s == pytest.approx(0.5 + 17.03)
    assert r1.exposed["replica"] == pytest.approx(17.03 - 2.06) and r1.backward_s == pytest.approx(r0.backward_s)
    assert sum(r1.exposed.values()) == pytest.approx(r1.layer_s)
    # a fast NIC (fetch 0.15 s): rank 1's slot rows start at 0.15 s, chunk ends 1.15 and 2.15 s, combines end 2.18 s
    fast = replace(TOY, rdma_bytes_per_s=1e4)
    assert sim.simulate(rep, fast, model=TOY_MODEL, execution=over).forward_s == pytest.approx(0.5 + 2.18)
    # nothing fetched: the same layer
    assert sim.simulate(static, TOY, model=TOY_MODEL, execution=over).layer_s == pytest.approx(
        sim.simulate(static, TOY, model=TOY_MODEL, execution=pipe).layer_s)
    with pytest.raises(ValueError, match="Execution.fetch_overlap=True overlaps the fetch with the chunk pipeline"):
        replace(SERIAL, fetch_overlap=True)


def test_fetch_overlap_stretches_the_dispatches_by_the_shared_links_bandwidth_not_their_latency():
    """One domain of 4 (1 s latency per transfer): the dispatch (60 B, 0 -> 1, in 2 chunks of 1.03 s) and the fetch
    (1500 B, 2 -> 1) share rank 1's NVLink port. The fetch's bytes delay the dispatches by 1.5 s (1560 B against 60 B
    on the busiest link); each chunk keeps its own latency: the dispatches end at 2.06 + 1.5 s, then the two combines
    (no compute here)."""
    topo = Topology(num_domains=1, ranks_per_domain=4)
    om = torch.tensor([[2, 0, 6, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    x = torch.zeros(4, 4, dtype=torch.bool)
    x[torch.arange(4), torch.arange(4)] = True
    x[2, 1] = True
    q = torch.zeros(4, 4, 4, dtype=torch.int64)
    q[0, 0, 0], q[0, 2, 1] = 2, 6
    plan = Plan.from_dense(x, q, om, topo, num_slots=1, expert_bytes=W, token_bytes=S).check()
    cl = replace(TOY, gpus_per_domain=4, nvlink_latency_s=1.0, rdma_latency_s=1.0)
    tok = sim.token_link_loads(plan, S, 2, dedup=False)
    rep = sim.link_loads(sim.replica_matrix(plan).double() * W, topo.domain_of)
    t_chunk = sim.transfer_time({k: v / 2 for k, v in tok.items()}, cl)[0]
    assert t_chunk == pytest.approx(1.03)
    t_rep = sim.transfer_time(rep, cl)[0]
    fwd = sim.overlapped_forward(plan, tok, rep, t_rep, t_chunk, cl, 2, 0.0, 0.0)
    assert fwd == pytest.approx(2.06 + 1.5 + 2 * 1.03)


@pytest.mark.parametrize("scenario", ["random_bias", "hot_domain", "warm_domain"])
def test_fetch_overlap_lies_between_no_fetch_and_the_fetch_first(scenario):
    """On plans with replicas whose fetch shares links with the dispatch (EP 16 as 2 domains): the overlapped
    forward is no slower than the fetch before the pipeline and no faster than the pipeline without any fetch."""
    cl, model = sim.CLUSTERS["paper_h800"], sim.MODELS["qwen3"].with_experts(16 * 8)
    om = workloads.scenario(scenario, 16, model.num_experts, 4096, model.top_k, ranks_per_domain=8, seed=0)
    plan = solve(om, cl.topology(16), num_slots=2, policy="topoep_plus", expert_bytes=model.expert_bytes,
                 token_bytes=model.token_bytes, t_ffn=cl.t_ffn(model))
    assert plan.num_replicas > 0
    ex = sim.EXECUTIONS["topoep"]
    r0, r1 = (sim.simulate(plan, cl, model=model, execution=replace(ex, fetch_overlap=o)) for o in (False, True))
    bare = r0.forward_s - r0.terms["fetch"]  # the same forward with the fetch taking no time
    assert bare - 1e-12 <= r1.forward_s < r0.forward_s  # the main experts' GEMMs hide part of the fetch here
    assert r1.backward_s == pytest.approx(r0.backward_s)


def test_exposed_terms_add_up_for_every_policy_and_execution():
    cl = sim.CLUSTERS["paper_h800"]
    model = sim.MODELS["qwen3"]
    om = sim.sample_routing(16, 128, 512, 8, router_skew=-2.0, seed=1)
    for ex in sim.EXECUTIONS.values():
        for policy in ("static", "topoep", "deepseek"):
            r = sim.simulate(om, cl, model=replace(model, tokens_per_rank=512), policy=policy, execution=ex)
            assert sum(r.exposed.values()) == pytest.approx(r.layer_s)
            assert r.layer_s == pytest.approx(r.forward_s + r.backward_s + r.exposed["overhead"])
            assert min(r.exposed.values()) >= -1e-12
            assert r.tokens_per_s == pytest.approx(16 * 512 / r.layer_s)
            row = r.row()
            assert row["exposed.compute"] == r.exposed["compute"] and "traffic.token_nic_bytes" in row


def test_simulate_applies_the_net_benefit_guard():
    from topoep.runtime.guard import NetBenefitGuard

    cl, model = sim.CLUSTERS["h200"], sim.MODELS["qwen3"]
    om = workloads.balanced_routing(8, 128, 256, 8)  # nothing to win: the guard executes the static plan
    model = replace(model, tokens_per_rank=256)
    r = sim.simulate(om, cl, model=model, policy="topoep", guard=NetBenefitGuard())
    static = sim.simulate(om, cl, model=model, policy="static")
    assert r.stats["num_replicas"] == 0 and r.policy == "topoep"
    # no plan could pay: planning was left out, the call costs what the static one does (both gather the counts,
    # as megatron's dispatcher does) plus the guard's selection on the device
    assert static.terms["plan"] == sim.gather_s(8, 128, cl) > 0 and static.terms["guard"] == 0
    # the slot hint's call (backend cuda): the bound beside the static plan the static layer runs too
    assert r.terms["guard"] == sim.gpu_hint_s(8) > 0 and sim.gpu_hint_s(8) < sim.gpu_decision_s(8, skipped=True)
    assert r.terms["plan"] == static.terms["plan"] + r.terms["guard"]
    assert r.layer_s == pytest.approx(static.layer_s + r.terms["guard"], rel=1e-12)
    no_hint = sim.simulate(om, cl, model=model, policy="topoep", guard=NetBenefitGuard(),
                           execution=replace(sim.EXECUTIONS["topoep"], slot_hint=False))
    assert no_hint.terms["guard"] == sim.gpu_decision_s(8, skipped=True) > sim.gpu_hint_s(8)  # the whole decision
    # skewed routing: planned (the planner's latency and the guard on top of the gather) and executed
    om = workloads.biased_routing(8, 128, 256, 8, -3.0, seed=1, layout="concentrated")
    r = sim.simulate(om, cl, model=model, policy="topoep", guard=NetBenefitGuard())
    assert r.stats["num_replicas"] > 0 and r.terms["plan"] == pytest.approx(
        sim.gather_s(8, 128, cl) + sim.gpu_planner_s(8) + sim.gpu_bound_s(8) + sim.gpu_guard_s(8))
    assert 0 < sim.gpu_bound_s(8) < sim.gpu_decision_s(8, skipped=True)  # the bound alone: less than a skipped call
    relayed = sim.simulate(om, cl, model=model, policy="topoep", guard=NetBenefitGuard(),
                           execution=replace(sim.EXECUTIONS["topoep"], relay_fanout=2))
    assert relayed.terms["guard"] == sim.gpu_guard_s(8, relay=True) > sim.gpu_guard_s(8)


def test_simulate_rejects_mismatched_plans():
    plan = solve(torch.ones(8, 16, dtype=torch.int64), Topology(num_domains=2, ranks_per_domain=4), num_slots=1,
                 policy="static", expert_bytes=W, token_bytes=S)
    with pytest.raises(ValueError, match="domains of 4 ranks"):
        sim.simulate(plan, TOY, model=TOY_MODEL)
    plan = solve(torch.ones(4, 4, dtype=torch.int64), TOY.topology(4), num_slots=1, policy="static")
    with pytest.raises(ValueError, match="expert_bytes"):
        sim.simulate(plan, TOY, model=TOY_MODEL)
    with pytest.raises(ValueError, match="Plan or an int64"):
        sim.simulate([[1, 2]], TOY, model=TOY_MODEL)


# -- plan cache -----------------------------------------------------------------------------------------
def _cache_case():
    cl, model = sim.CLUSTERS["paper_h800"], replace(sim.MODELS["qwen3"], num_experts=64, tokens_per_rank=256)
    om = sim.sample_routing(16, 64, 256, 8, router_skew=-2.0, seed=5)
    kw = dict(expert_bytes=model.expert_bytes, token_bytes=model.token_bytes, t_ffn=cl.t_ffn(model))
    return cl, model, om, cl.topology(16), kw


@pytest.mark.parametrize("policy", POLICIES)
def test_plan_cache_returns_the_reference_plan(tmp_path, policy):
    cl, model, om, topo, kw = _cache_case()
    if policy.startswith("topoep_plus_spread"):  # the spread planners' stopping threshold as the simulator asks
        kw = kw | {"move_cost_fs": sim.spread_move_cost_fs(sim.EXECUTIONS["topoep"])}
    ref = solve(om, topo, num_slots=2, policy=policy, backend="reference", **kw)
    writer = sim.PlanCache(tmp_path, min_solve_s=0.0, memory=0)
    made, t_made = writer.solve(om, topo, num_slots=2, policy=policy, **kw)
    assert (writer.misses, writer.written, writer.hits) == (1, 1, 0)
    reader = sim.PlanCache(tmp_path, min_solve_s=0.0, memory=0)  # a fresh process: from disk
    read, t_read = reader.solve(om.clone(), topo, num_slots=2, policy=policy, **kw)
    assert (reader.hits, reader.misses) == (1, 0) and t_read == t_made  # the solve's time as measured then
    for plan in (made, read):
        assert torch.equal(plan.route, ref.route) and torch.equal(plan.slot_expert, ref.slot_expert)
        assert torch.equal(plan.main_rank, ref.main_rank) and torch.equal(plan.omega, ref.omega)
        assert (plan.policy, plan.info, plan.num_slots) == (ref.policy, ref.info, ref.num_slots)
        assert (plan.expert_bytes, plan.token_bytes) == (ref.expert_bytes, ref.token_bytes)
    a = sim.simulate(om, cl, model=model, policy=policy, num_slots=2)
    b = sim.simulate(om, cl, model=model, policy=policy, num_slots=2, plan_cache=reader)
    assert b.layer_s == a.layer_s and b.stats == a.stats and b.traffic == a.traffic
    assert b.terms["reference_solve_measured"] == t_made


def test_plan_cache_keys_every_input_and_survives_bad_entries(tmp_path):
    cl, model, om, topo, kw = _cache_case()
    cache = sim.PlanCache(tmp_path, min_solve_s=0.0, memory=0)
    key = cache.key(om, topo, num_slots=2, policy="topoep", **kw)
    om2 = om.clone()
    om2[0, 0] += 1
    other = [cache.key(om2, topo, num_slots=2, policy="topoep", **kw),
             cache.key(om, sim.CLUSTERS["h200"].topology(16), num_slots=2, policy="topoep", **kw),  # other costs
             cache.key(om, Topology(num_domains=4, ranks_per_domain=4), num_slots=2, policy="topoep", **kw),
             cache.key(om, topo, num_slots=3, policy="topoep", **kw),
             cache.key(om, topo, num_slots=2, policy="flexmoe", **kw),
             cache.key(om, topo, num_slots=2, policy="topoep", **(kw | {"t_ffn": 2 * kw["t_ffn"]})),
             cache.key(om, topo, num_slots=2, policy="topoep", **(kw | {"expert_bytes": kw["expert_bytes"] + 2}))]
    assert len({key, *other}) == len(other) + 1
    planner_changed = sim.PlanCache(tmp_path)
    planner_changed.fingerprint = "0" * 64
    assert planner_changed.key(om, topo, num_slots=2, policy="topoep", **kw) != key
    ref = solve(om, topo, num_slots=2, policy="topoep", backend="reference", **kw)
    cache.solve(om, topo, num_slots=2, policy="topoep", **kw)
    path = cache.path(key)
    assert path.is_file()
    path.write_bytes(b"not a plan")  # unreadable: solved again and rewritten
    again = sim.PlanCache(tmp_path, min_solve_s=0.0, memory=0)
    plan, _ = again.solve(om, topo, num_slots=2, policy="topoep", **kw)
    assert (again.hits, again.misses, again.written) == (0, 1, 1) and torch.equal(plan.route, ref.route)
    # fast solves are not written; the last plan is served from memory
    lazy = sim.PlanCache(tmp_path / "lazy", min_solve_s=1e9, memory=1)
    for _ in range(2):
        plan, _ = lazy.solve(om, topo, num_slots=2, policy="deepseek", **kw)
    assert (lazy.misses, lazy.hits, lazy.written) == (1, 1, 0) and not (tmp_path / "lazy").exists()
    assert torch.equal(plan.route, solve(om, topo, num_slots=2, policy="deepseek", **kw).route)
    with pytest.raises(ValueError, match="num_slots"):
        cache.solve(om, topo, num_slots=-1, policy="topoep", **kw)


# -- configs and presets ---------------------------------------------------------------------------------
def test_presets():
    assert {"paper_h800", "gb200_nvl72", "h200"} <= set(sim.CLUSTERS)
    paper = sim.CLUSTERS["paper_h800"]
    assert paper.gpus_per_domain == 8 and paper.rdma_bytes_per_s < 50e9 < paper.nvlink_bytes_per_s
    t = paper.topology(32)
    assert (t.num_domains, t.ranks_per_domain) == (4, 8)
    assert t.cost[0, 1].item() == pytest.approx(1 / paper.nvlink_bytes_per_s)
    assert t.cost[0, 8].item() == pytest.approx(1 / paper.rdma_bytes_per_s)
    nvl = sim.CLUSTERS["gb200_nvl72"]
    assert [nvl.domain_size(R) for R in (8, 64, 72, 128, 1024)] == [8, 64, 72, 64, 64]
    assert sim.CLUSTERS["h200"].domain_size(2) == 2  # the GPU machine's EP 2: one domain
    assert {"topoep", "megatron", "torch", "cuda"} <= set(sim.EXECUTIONS)
    assert sim.EXECUTIONS["topoep"].exposed_replica_transfers == 1 and sim.EXECUTIONS["torch"].exposed_replica_transfers == 3
    assert sim.EXECUTIONS["cuda"].exposed_replica_transfers == 3 and sim.EXECUTIONS["cuda"].num_chunks == 1
    # presets from another H200 fit: h200 takes both constants, the other GPUs its GEMM efficiency
    fit = sim.presets(5e14, 2e11)
    assert fit.keys() == sim.CLUSTERS.keys() and sim.presets() == sim.CLUSTERS
    assert (fit["h200"].gemm_flops_per_s, fit["h200"].nvlink_bytes_per_s) == (5e14, 2e11)
    assert fit["paper_h800"].gemm_flops_per_s == pytest.approx(5e14)  # same BF16 peak as the H200
    assert fit["gb200_nvl72"].gemm_flops_per_s == pytest.approx(5e14 / sim.H100_PEAK_BF16 * 2.5e15)
    assert fit["paper_h800"].nvlink_bytes_per_s == paper.nvlink_bytes_per_s  # DeepEP's numbers, not the fit
    assert not sim.EXECUTIONS["megatron"].dedup and sim.EXECUTIONS["topoep"].dedup
    q = sim.MODELS["qwen3"]
    assert (q.expert_bytes, q.token_bytes) == (3 * 2048 * 768 * 2, 4096)
    assert paper.t_ffn(q) == pytest.approx(18 * 2048 * 768 / paper.gemm_flops_per_s)
    for m in sim.MODELS.values():
        assert 1e8 < m.dense_flops_per_token < 5e9  # attention etc.: same order as the routed experts


@pytest.mark.parametrize("make, match", [
    (lambda: replace(TOY, gpus_per_domain=0), "Cluster.gpus_per_domain"),
    (lambda: replace(TOY, nvlink_bytes_per_s=0.0), "Cluster.nvlink_bytes_per_s"),
    (lambda: replace(TOY, rdma_bytes_per_s=float("nan")), "Cluster.rdma_bytes_per_s"),
    (lambda: replace(TOY, rdma_latency_s=-1e-6), "Cluster.rdma_latency_s"),
    (lambda: replace(TOY, gpus_per_domain=8.0), "Cluster.gpus_per_domain"),
    (lambda: replace(TOY_MODEL, top_k=5), "top_k=5 must be <= num_experts=4"),
    (lambda: replace(TOY_MODEL, hidden_size=0), "ModelShape.hidden_size"),
    (lambda: replace(SERIAL, num_chunks=0), "Execution.num_chunks"),
    (lambda: replace(SERIAL, plan_s=-1.0), "Execution.plan_s"),
    (lambda: replace(SERIAL, row_overhead_s=float("inf")), "Execution.row_overhead_s"),
])
def test_config_validation_names_the_field(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_domain_size_rejects_bad_rank_counts():
    with pytest.raises(ValueError, match="num_ranks"):
        TOY.domain_size(0)


def test_gpu_planner_latency_model():
    for R, us in sim.GPU_PLANNER_US:
        assert sim.gpu_planner_s(R) == pytest.approx(us * 1e-6)
    assert sim.gpu_planner_s(2) == pytest.approx(sim.GPU_PLANNER_US[0][1] * 1e-6)
    for relay, pts in ((False, sim.GPU_GUARD_US), (True, sim.GPU_GUARD_RELAY_US)):
        for R, us in pts:
            assert sim.gpu_guard_s(R, relay) == pytest.approx(us * 1e-6)
    for relay, skipped, pts in ((False, True, sim.GPU_DECISION_SKIP_US), (True, True, sim.GPU_DECISION_SKIP_RELAY_US),
                                (False, False, sim.GPU_DECISION_PLUS_US), (True, False, sim.GPU_DECISION_PLUS_RELAY_US)):
        for R, us in pts:
            assert sim.gpu_decision_s(R, relay, skipped) == pytest.approx(us * 1e-6)
    for (R, hint), (_, hint_relay), (_, static) in zip(sim.GPU_DECISION_HINT_US, sim.GPU_DECISION_HINT_RELAY_US,
                                                       sim.GPU_STATIC_PLAN_US):  # the hint's call beside static
        assert sim.gpu_hint_s(R) == pytest.approx((hint - static) * 1e-6)
        assert sim.gpu_hint_s(R, relay=True) == pytest.approx((hint_relay - static) * 1e-6)
    for R, _ in sim.GPU_DECISION_PLUS_US:  # a guarded topoep_plus layer's planned decision, put back together
        for relay in (False, True):
            assert (sim.gpu_planner_s(R, "topoep_plus") + sim.gpu_bound_s(R, relay) + sim.gpu_guard_s(R, relay)
                    == pytest.approx(sim.gpu_decision_s(R, relay)))
    assert sim.gpu_planner_s(128) < sim.gpu_planner_s(256) < sim.gpu_planner_s(1024)
    (_, lo), (_, hi) = sim.GPU_PLANNER_US[1:3]  # EP 16 and 32
    assert min(lo, hi) * 1e-6 < sim.gpu_planner_s(24) < max(lo, hi) * 1e-6  # interpolated between them


def test_planner_latency_grows_with_the_domain_for_the_refined_policies():
    """GPU_DOMAIN_EXTRA_US: domains of more than 8 ranks add their refinement's time to topoep, topoep_plus and its
    local plan (measured one-domain points, 0 at 8, interpolated in log2 between, linear beyond 64), not to the peers'
    or the spread planner's; a one-domain GB200 layer is charged it, the same layer in domains of 8 is not."""
    for (rpd, extra), (_, extra_plus) in zip(sim.GPU_DOMAIN_EXTRA_US, sim.GPU_DOMAIN_EXTRA_PLUS_US):
        for R in (64, 128):
            # several domains of that size refine at once, the slowest setting the time (GPU_GROUPS_EXTRA_SCALE)
            scale, scale_plus = sim.GPU_GROUPS_EXTRA_SCALE if R > rpd else (1.0, 1.0)
            assert sim.gpu_planner_s(R, "topoep", rpd) == pytest.approx(sim.gpu_planner_s(R) + extra * scale * 1e-6)
            for policy in ("topoep_plus", "topoep_plus_local"):
                assert sim.gpu_planner_s(R, policy, rpd) == pytest.approx(sim.gpu_planner_s(R, policy)
                                                                          + extra_plus * scale_plus * 1e-6)
            for policy in ("deepseek", "flexmoe", "topoep_plus_spread"):
                assert sim.gpu_planner_s(R, policy, rpd) == sim.gpu_planner_s(R, policy)
    assert sim.gpu_planner_s(64, "topoep", 4) == sim.gpu_planner_s(64)
    assert 18.9e-6 < sim.gpu_planner_s(24, "topoep", 24) - sim.gpu_planner_s(24) < 72.0e-6  # between 16 and 32
    assert sim.gpu_planner_s(72, "topoep", 72) - sim.gpu_planner_s(72) > 613.8e-6  # beyond 64: the last slope
    # the measured point: 2 groups of 32 at EP 64 add 99.3 us (H100) where one domain of 32 adds 71.0
    assert sim.gpu_planner_s(64, "topoep", 32) - sim.gpu_planner_s(64) == pytest.approx(72.0e-6 * 99.3 / 71.0)
    cl, model = sim.CLUSTERS["gb200_nvl72"], sim.MODELS["qwen3"].with_experts(32 * 8)
    om = workloads.scenario("hot_rank", 32, model.num_experts, 4096, model.top_k, ranks_per_domain=32, seed=0)
    whole = replace(sim.EXECUTIONS["topoep"], plan_domain=None)  # the planner on the whole domain of 32
    one = sim.simulate(om, cl, model=model, policy="topoep", num_slots=2, execution=whole)
    eight = sim.simulate(om, replace(cl, gpus_per_domain=8), model=model, policy="topoep", num_slots=2, execution=whole)
    gap = sim.gpu_planner_s(32, "topoep", 32) - sim.gpu_planner_s(32, "topoep", 8)
    assert one.exposed["plan"] - sim.gather_s(32, model.num_experts, cl) == pytest.approx(
        eight.exposed["plan"] - sim.gather_s(32, model.num_experts, replace(cl, gpus_per_domain=8)) + gap)


# -- workloads -------------------------------------------------------------------------------------------
def test_sample_routing_exact_and_sampled_agree():
    R, E, T, k = 8, 64, 2048, 8
    exact = sim.sample_routing(R, E, T, k, router_skew=-1.5, seed=2, method="exact")
    assert torch.equal(exact, workloads.biased_routing(R, E, T, k, -1.5, seed=2))
    sampled = sim.sample_routing(R, E, T, k, router_skew=-1.5, seed=2, method="sampled")
    assert sampled.shape == (R, E) and (sampled.sum(1) == T * k).all()
    a, b = exact.sum(0).double(), sampled.sum(0).double()
    assert (a - b).abs().sum() / a.sum() < 0.05  # same expert popularity


def test_natural_like_routing_matches_the_papers_expert_skew():
    om = sim.sample_routing(8, 128, 4096, 8, natural=True, seed=0)
    load = om.sum(0).double()
    assert abs((load.max() / load.mean()).item() - sim.NATURAL_MAX_OVER_MEAN) < 0.4
    with pytest.raises(ValueError, match="exactly one"):
        sim.sample_routing(8, 128, 64, 8)
    with pytest.raises(ValueError, match="exactly one"):
        sim.sample_routing(8, 128, 64, 8, router_skew=-1.0, natural=True)
    with pytest.raises(ValueError, match="method"):
        sim.sample_routing(8, 128, 64, 8, router_skew=-1.0, method="fast")


# -- calibration -----------------------------------------------------------------------------------------
def synthetic_cases(true_cluster, true_ex, backend="torch", host_ms=0.0):
    """Measured cases made by the model itself (phases and totals) with known constants. host_ms is added to
    every serialised phase but not to the totals (host launch time that a stream without host syncs hides)."""
    cases = []
    H, F, E, k = 64, 32, 8, 2
    topo = Topology(num_domains=1, ranks_per_domain=2)
    for T in (128, 512):
        model = sim.ModelShape(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=k, tokens_per_rank=T)
        for i, (skew, layout) in enumerate([(0.0, "random"), (-2.0, "concentrated"), (-3.0, "clustered")]):
            om = workloads.biased_routing(2, E, T, k, skew, seed=i, layout=layout)
            for policy in ("static", "topoep"):
                plan = solve(om, topo, num_slots=2, policy=policy, expert_bytes=3 * H * F * 2, token_bytes=H * 2)
                r = sim.simulate(plan, true_cluster, model=model, execution=true_ex)
                t = r.terms
                phases = {"plan": 1e3 * t["plan"], "fetch": 2e3 * t["fetch"], "grad_return": 1e3 * t["grad_return"],
                          "dispatch_combine": 1e3 * (t["dispatch_combine_fwd"] + t["dispatch_combine_bwd"]),
                          "experts": 1e3 * (t["expert_fwd_straggler"] + t["expert_bwd_straggler"])}
                phases = {k: v + host_ms for k, v in phases.items()}
                per_rank = [1e3 * (true_ex.expert_overhead_s + true_cluster.t_ffn(model) * L) + host_ms
                            for L in plan.rank_load.tolist()]
                cases.append(sim.MeasuredCase(tokens=T, workload=f"{skew} {layout}", policy=policy, plan=plan,
                                              measured_ms=1e3 * r.layer_s, phases_ms=phases,
                                              experts_ms_per_rank=per_rank, backend=backend))
    return cases


def test_calibrate_recovers_known_constants():
    true_cluster = replace(sim.CLUSTERS["h200"], gemm_flops_per_s=3e14, nvlink_bytes_per_s=2.5e11)
    true_ex = replace(sim.EXECUTIONS["torch"], expert_overhead_s=1e-3, comm_overhead_s=2e-3, replica_latency_s=3e-4,
                      static_plan_s=4e-4, plan_s=1.2e-3, layer_overhead_s=5e-4, row_overhead_s=2e-8)
    cases = synthetic_cases(true_cluster, true_ex)
    assert any(c.plan.num_replicas for c in cases)
    cal = sim.calibrate(cases)
    f = cal.fitted
    assert f["gemm_flops_per_s"] == pytest.approx(3e14, rel=1e-6)
    assert f["nvlink_bytes_per_s"] == pytest.approx(2.5e11, rel=1e-6)
    for name, want in (("expert_overhead_s", 1e-3), ("comm_overhead_s", 2e-3), ("replica_latency_s", 3e-4),
                       ("static_plan_s", 4e-4), ("plan_s", 1.2e-3), ("layer_overhead_s", 5e-4), ("row_overhead_s", 2e-8)):
        assert f[name] == pytest.approx(want, rel=1e-5, abs=1e-12), name
    for c in cases:
        assert sim.predict(c, cal).layer_s * 1e3 == pytest.approx(c.measured_ms, rel=1e-6)
    # one token count only: the per-assignment overhead cannot be separated from the fixed part
    one_t = sim.calibrate([c for c in cases if c.tokens == 128])
    assert one_t.fitted["row_overhead_s"] == 0.0


def test_calibrate_cuda_fits_fixed_costs_on_the_totals():
    """Backend cuda: one chunk, serial; the phases carry host launch time the totals do not (host_ms), so only
    the phases' slopes are used and the fixed costs come from the totals."""
    true_cluster = replace(sim.CLUSTERS["h200"], gemm_flops_per_s=6e14, nvlink_bytes_per_s=2.8e11)
    true_ex = replace(sim.EXECUTIONS["cuda"], layer_overhead_s=2e-3, row_overhead_s=3e-8, plan_s=3e-4)
    assert (true_ex.num_chunks, true_ex.pipelined, true_ex.dedup) == (1, False, False)
    cases = synthetic_cases(true_cluster, true_ex, backend="cuda", host_ms=0.4)
    assert any(c.plan.num_replicas for c in cases)
    cal = sim.calibrate(cases)
    f = cal.fitted
    assert (f["backend"], f["fixed"], f["num_chunks"], f["pipelined"]) == ("cuda", "totals", 1, False)
    assert f["gemm_flops_per_s"] == pytest.approx(6e14, rel=1e-6)
    assert f["nvlink_bytes_per_s"] == pytest.approx(2.8e11, rel=1e-6)
    for name, want in (("layer_overhead_s", 2e-3), ("row_overhead_s", 3e-8), ("balancing_overhead_s", 3e-4),
                       ("plan_s", 3e-4)):
        assert f[name] == pytest.approx(want, rel=1e-5, abs=1e-12), name
    assert f["phase_expert_intercept_s"] == pytest.approx(0.4e-3, rel=1e-6)  # measured, not in the model
    ex = cal.execution
    assert ex.expert_overhead_s == ex.comm_overhead_s == ex.replica_latency_s == ex.static_plan_s == 0.0
    for c in cases:
        assert sim.predict(c, cal).layer_s * 1e3 == pytest.approx(c.measured_ms, rel=1e-6)
    # the phases' intercepts as fixed costs put the host time where the totals do not have it
    by_phase = sim.calibrate(cases, fixed="phases")
    assert by_phase.fitted["fixed"] == "phases" and by_phase.execution.expert_overhead_s == pytest.approx(0.4e-3)
    assert max(abs(sim.predict(c, by_phase).layer_s * 1e3 / c.measured_ms - 1) for c in cases) > 0.01
    # the paper's two-chunk schedule for comparison; backends are never mixed
    assert sim.calibrate(cases, pipelined=True).execution.num_chunks == 2
    with pytest.raises(ValueError, match="one backend"):
        sim.calibrate(cases + synthetic_cases(true_cluster, sim.EXECUTIONS["torch"])[:1])
    with pytest.raises(ValueError, match="fixed"):
        sim.calibrate(cases, fixed="guess")


@pytest.mark.skipif(not (REPO / "results" / "moe_layer.json").exists(), reason="no GPU bench results")
def test_calibrate_on_the_benchs_cuda_rows():
    cases = sim.measured_cases(REPO / "results" / "moe_layer.json", backend="cuda")
    assert cases and {c.backend for c in cases} == {"cuda"} and {c.policy for c in cases} == {"static", "topoep"}
    cal = sim.calibrate(cases)
    assert cal.fitted["fixed"] == "totals" and cal.execution.num_chunks == 1 and not cal.execution.pipelined
    ex = cal.execution
    assert min(ex.layer_overhead_s, ex.row_overhead_s, ex.plan_s) >= 0.0
    assert 1e14 < cal.cluster.gemm_flops_per_s < 989e12 and 1e10 < cal.cluster.nvlink_bytes_per_s < 9e11
    # the target, in sample (bench/simulate.py reports leave-one-out and held-out predictions)
    for c in cases:
        assert sim.predict(c, cal).layer_s * 1e3 == pytest.approx(c.measured_ms, rel=0.15), (c.tokens, c.workload)


def test_calibrate_rejects_cases_it_cannot_fit():
    true_cluster = replace(sim.CLUSTERS["h200"], gemm_flops_per_s=3e14)
    cases = synthetic_cases(true_cluster, sim.EXECUTIONS["torch"])
    falling = [replace(c, experts_ms_per_rank=[10.0 - 1e-4 * L for L in c.plan.rank_load.tolist()]) for c in cases]
    with pytest.raises(ValueError, match="experts phase"):
        sim.calibrate(falling)
    two_domains = [replace(c, plan=solve(c.plan.omega, Topology(num_domains=2, ranks_per_domain=1), num_slots=0,
                                         policy="static", expert_bytes=c.plan.expert_bytes,
                                         token_bytes=c.plan.token_bytes)) for c in cases]
    with pytest.raises(ValueError, match="one NVLink domain"):
        sim.calibrate(two_domains)


@pytest.mark.skipif(not (REPO / "results" / "moe_layer.json").exists(), reason="no GPU bench results")
def test_measured_cases_rebuild_the_executed_plans():
    from topoep.metrics import ffn_time_per_assignment
    from topoep.runtime.guard import NetBenefitGuard

    cases = sim.measured_cases(REPO / "results" / "moe_layer.json")
    assert {c.policy for c in cases} == {"static", "topoep"} and len({c.tokens for c in cases}) >= 1
    for c in cases:
        assert c.plan.omega.sum() == c.tokens * 8 * 2  # top-8 on 2 ranks
        if c.guard_fired is not None:  # the recorded decision is the guard's on the rebuilt plan
            balanced = solve(c.plan.omega, c.plan.topology, num_slots=2, policy="topoep",
                             expert_bytes=c.plan.expert_bytes, token_bytes=c.plan.token_bytes)
            # the guard of those runs priced compute and replicas only: token_transfers=0
            fired = NetBenefitGuard(token_transfers=0).select(balanced, ffn_time_per_assignment(2048, 768), 3)[1]
            assert bool(fired) == c.guard_fired
    with pytest.raises(ValueError, match="no 'absent/static'"):  # a backend the bench did not run
        sim.measured_cases(REPO / "results" / "moe_layer.json", backend="absent")


def _spread_moves(om, cl, model, slots: int, policies, speedup: float = 1.0) -> int:
    """The most greedy moves of the spread planners among `policies` on om (what the simulator times them by), at
    the measured planner's stopping threshold (divided by `speedup`)."""
    topo = cl.topology(om.shape[0])
    ex = replace(sim.EXECUTIONS["topoep"], spread_planner="measured", spread_speedup=speedup)
    return max(solve(om, topo, policy=p, num_slots=slots, expert_bytes=model.expert_bytes,
                     token_bytes=model.token_bytes, t_ffn=cl.t_ffn(model),
                     move_cost_fs=sim.spread_move_cost_fs(ex)).info["greedy_moves"]
               for p in policies if p.startswith("topoep_plus_spread"))


def test_measured_spread_planner_charges_its_time_where_a_spread_plan_is_planned():
    """spread_planner="measured", no spread gate: a guarded topoep_plus layer with the spread candidate pays the CUDA
    spread planner's measured latency for the moves its greedy made in the call (gpu_spread_s; the four plans of a
    relayed layer at once) instead of topoep_plus's; a layer without a spread candidate, and the plan it runs, are
    unchanged."""
    cl, model = sim.CLUSTERS["paper_h800"], sim.MODELS["qwen3"].with_experts(32 * 8)
    om = workloads.scenario("warm_domain", 32, model.num_experts, 4096, model.top_k, ranks_per_domain=8, seed=0)
    from topoep.runtime import NetBenefitGuard

    guard = NetBenefitGuard()
    ex = sim.EXECUTIONS["topoep"]
    for fanout, cands in ((None, ("topoep_plus_local", "topoep_plus_spread")),
                          (2, ("topoep_plus_local", "topoep_plus_spread", "topoep_plus_spread_tree"))):
        runs = [sim.simulate(om, cl, model=model, policy="topoep_plus", guard=guard, plus_candidates=c,
                             execution=replace(ex, relay_fanout=fanout, spread_planner=mode, spread_gate=False))
                for mode in ("plus", "measured") for c in (cands, ("topoep_plus_local",))]
        (plus, plus_local), (measured, measured_local) = runs[:2], runs[2:]
        moves = _spread_moves(om, cl, model, 2, cands)
        extra = sim.gpu_spread_s(32, fanout is not None, moves) - sim.gpu_planner_s(32, "topoep_plus")
        assert extra > 0.05e-3  # (a difference the checks below can see)
        assert measured.terms["plan"] == pytest.approx(plus.terms["plan"] + extra)
        assert measured.layer_s == pytest.approx(plus.layer_s + extra)
        assert measured.stats["guard_choice"] == plus.stats["guard_choice"]  # the same plan runs
        assert measured_local.layer_s == pytest.approx(plus_local.layer_s)
    with pytest.raises(ValueError, match="spread_planner='fast' is unknown"):
        replace(ex, spread_planner="fast")


@pytest.mark.parametrize("scen, slots, on", [("warm_domain", 2, True), ("hot_domain", 1, False)])
def test_spread_gate_in_steady_state(scen, slots, on):
    """Execution.spread_gate (the runtime's SpreadGate in steady state), measured spread planner, EP 32: where the
    guard keeps a spread plan that beats the other two by more than the spread planner's time (warm domain) the gated
    layer is the ungated one plus the gate's time on all but one call in spread_probe, and the layer without the spread
    candidate on that one; elsewhere (hot domain, 1 slot) it runs the other two's plan with the gate's time and the
    spread planner's time beyond topoep_plus's on one call in spread_probe."""
    from topoep.runtime import NetBenefitGuard

    cl, model = sim.CLUSTERS["paper_h800"], sim.MODELS["qwen3"].with_experts(32 * 8)
    om = workloads.scenario(scen, 32, model.num_experts, 4096, model.top_k, ranks_per_domain=8, seed=0)
    ex = replace(sim.EXECUTIONS["topoep"], spread_planner="measured", spread_probe=16)
    cands = ("topoep_plus_local", "topoep_plus_spread")

    def run(candidates, gate):
        return sim.simulate(om, cl, model=model, policy="topoep_plus", num_slots=slots, guard=NetBenefitGuard(),
                            plus_candidates=candidates, execution=replace(ex, spread_gate=gate))

    gated, ungated, plain = run(cands, True), run(cands, False), run(("topoep_plus_local",), False)
    gate_s = sim._interpolated_s(sim.GPU_SPREAD_GATE_US, 32)
    assert gated.stats["spread_gate"] == float(on) and ungated.stats["spread_gate"] == -1.0
    if on:
        assert ungated.stats["guard_choice"] == 2.0 and gated.stats["guard_choice"] == 2.0
        assert gated.layer_s == pytest.approx((15 * (ungated.layer_s + gate_s) + plain.layer_s) / 16)
        # the breakdown is averaged the same way: it sums to the layer, the probe's plan time in its share
        assert gated.exposed["plan"] == pytest.approx((15 * (ungated.exposed["plan"] + gate_s)
                                                       + plain.exposed["plan"]) / 16)
        assert gated.exposed["replica"] == pytest.approx((15 * ungated.exposed["replica"]
                                                          + plain.exposed["replica"]) / 16)
    else:
        extra = (sim.gpu_spread_s(32, moves=_spread_moves(om, cl, model, slots, cands))
                 - sim.gpu_planner_s(32, "topoep_plus")) / 16
        assert gated.stats["guard_choice"] == plain.stats["guard_choice"]
        assert gated.layer_s == pytest.approx(plain.layer_s + gate_s + extra)
        assert gated.layer_s < ungated.layer_s
    assert sum(gated.exposed.values()) == pytest.approx(gated.layer_s)
    with pytest.raises(ValueError, match="spread_probe"):
        replace(ex, spread_probe=1)


def test_spread_speedup_divides_the_measured_planner_time():
    cl, model = sim.CLUSTERS["paper_h800"], sim.MODELS["qwen3"].with_experts(32 * 8)
    om = workloads.scenario("warm_domain", 32, model.num_experts, 4096, model.top_k, ranks_per_domain=8, seed=0)
    from topoep.runtime import NetBenefitGuard

    ex = replace(sim.EXECUTIONS["topoep"], spread_planner="measured", spread_gate=False)
    r1, r10 = (sim.simulate(om, cl, model=model, policy="topoep_plus", guard=NetBenefitGuard(),
                            plus_candidates=("topoep_plus_local", "topoep_plus_spread"),
                            execution=replace(ex, spread_speedup=x)) for x in (1.0, 10.0))
    # a planner 10x faster: a tenth of the time for the moves it makes, and its greedy stops 10x later; the plans
    # beside it (topoep_plus and its local plan) then take longer, and the longer chain sets the time
    m1, m10 = (_spread_moves(om, cl, model, 2, ("topoep_plus_spread",), x) for x in (1.0, 10.0))
    assert m10 > m1
    plus = sim.gpu_planner_s(32, "topoep_plus")
    fast = sim.gpu_spread_s(32, moves=m10) / 10
    assert fast < plus < sim.gpu_spread_s(32, moves=m1)
    assert r1.terms["plan"] - r10.terms["plan"] == pytest.approx(sim.gpu_spread_s(32, moves=m1) - plus)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="spread_speedup must be a finite number > 0"):
            replace(ex, spread_speedup=bad)
    with pytest.raises(ValueError, match="scales the measured spread planner"):
        replace(sim.EXECUTIONS["topoep"], spread_speedup=2.0)


def test_forced_choice_runs_each_planned_plan():
    """force_choice (the guard oracle of bench/link_sweep.py --oracle): forcing the guard's own pick reproduces the
    guarded layer; forcing each plan runs that plan (its imbalance, the same plan time), -1 the static plan; a choice
    outside the plans planned, or on a layer that does not choose, is refused."""
    from topoep.runtime import NetBenefitGuard

    cl, model = sim.CLUSTERS["paper_h800"], sim.MODELS["qwen3"].with_experts(32 * 8)
    om = workloads.scenario("random_bias", 32, model.num_experts, 4096, model.top_k, ranks_per_domain=8, seed=0)
    ex = replace(sim.EXECUTIONS["topoep"], relay_fanout=2)
    cands = ("topoep_plus_local", "topoep_plus_spread")

    def run(**kw):
        return sim.simulate(om, cl, model=model, policy="topoep_plus", guard=NetBenefitGuard(), plus_candidates=cands,
                            execution=ex, **kw)

    guarded = run()
    assert guarded.stats["plans_planned"] == 3.0
    forced = [run(force_choice=i) for i in (-1, 0, 1, 2)]
    pick = int(guarded.stats["guard_choice"])
    assert forced[1 + pick].layer_s == pytest.approx(guarded.layer_s)
    assert forced[0].stats["num_replicas"] == 0 and forced[0].stats["imbalance"] == pytest.approx(
        forced[0].stats["static_imbalance"])
    for i, r in enumerate(forced[1:]):
        assert r.stats["guard_choice"] == float(i) and r.stats["num_replicas"] > 0
        assert r.terms["plan"] == pytest.approx(guarded.terms["plan"])
    assert len({round(r.layer_s, 9) for r in forced}) > 1  # the plans differ in time
    with pytest.raises(ValueError, match="force_choice=3 picks one of the 3 plans"):
        run(force_choice=3)
    with pytest.raises(ValueError, match="force_choice=0"):
        sim.simulate(om, cl, model=model, policy="topoep", guard=NetBenefitGuard(), execution=ex, force_choice=0)


def test_async_relay_fetch_is_the_longer_of_busiest_link_and_chain():
    """Execution.relay_schedule="async" (a what-if): a relayed fetch takes the longer of its busiest link over all
    levels and its longest chain of hops; never more than the levels one after the other."""
    from topoep.links import link_loads
    from topoep.relay import relay_levels, relay_sources
    from topoep.workloads import biased_routing

    cl = sim.CLUSTERS["paper_h800"]
    topo = cl.topology(16)  # 2 domains of 8
    W = 1e8
    base = solve(biased_routing(16, 32, 256, 2, -4.0, seed=0, layout="clustered"), topo, num_slots=2,
                 policy="static", expert_bytes=int(W), token_bytes=10)
    # expert 0 (home rank 0) on ranks 1, 2 (domain 0: the home sends both) and 8, 9, 10 (domain 1: 8 from the home
    # over the NIC, 9 and 10 from 8 over NVLink)
    se = torch.full((16, 2), -1, dtype=torch.int64)
    for r in (1, 2, 8, 9, 10):
        se[r, 0] = 0
    plan = replace(base, slot_expert=se)
    src, lvl = relay_sources(plan, 2)
    assert src[8, 0] == 0 and src[9, 0] == 8 and src[10, 0] == 8 and int(lvl.max()) == 2
    dom = topo.domain_of
    flows = relay_levels(plan, src, lvl)
    loads = {k: v for k, v in link_loads(flows.sum(0).double() * W, dom).as_dict().items()}
    chain = W / cl.rdma_bytes_per_s + cl.rdma_latency_s + W / cl.nvlink_bytes_per_s + cl.nvlink_latency_s
    busiest = sim.transfer_time(loads, cl)[0]
    assert sim.async_fetch_s(plan, src, lvl, loads, cl, W) == pytest.approx(max(chain, busiest))
    levels = sum(sim.transfer_time(link_loads(f.double() * W, dom).as_dict(), cl)[0] for f in flows)
    assert sim.async_fetch_s(plan, src, lvl, loads, cl, W) <= levels + 1e-12
    # a whole layer (drifting hot set: the remote roots' NIC copies dominate, their NVLink forwards overlap them)
    om = workloads.scenario("drifting", 16, 128, 4096, 8, ranks_per_domain=8, seed=0)
    model = sim.MODELS["qwen3"].with_experts(128)
    ex = replace(sim.EXECUTIONS["topoep"], relay_fanout=2)
    runs = {s: sim.simulate(om, cl, model=model, policy="topoep_plus", num_slots=2,
                            execution=replace(ex, relay_schedule=s)) for s in sim.RELAY_SCHEDULES}
    assert runs["levels"].stats["num_replicas"] > 0
    assert runs["async"].terms["fetch"] < runs["levels"].terms["fetch"]


def test_relay_schedule_is_checked():
    with pytest.raises(ValueError, match="relay_schedule='tree'"):
        replace(sim.EXECUTIONS["topoep"], relay_schedule="tree")
    with pytest.raises(ValueError, match="relay_chunks must be 1"):
        replace(sim.EXECUTIONS["topoep"], relay_fanout=2, relay_chunks=2, relay_schedule="async")


@pytest.mark.parametrize("policy", ["deepseek", "flexmoe"])
def test_peers_on_the_gpu_pay_their_measured_planner_instead_of_the_host_path(policy):
    """Execution.peers_on_gpu: a peer with a CUDA planner (csrc/peers.cu) is charged its measured time alone instead of
    the host round trip, the counts' copy and a planner as fast as ours; everything else of the call is the same."""
    from topoep.planners.baselines import peer_solo_s

    cl = sim.CLUSTERS["h200"]
    model = sim.MODELS["qwen3"].with_experts(32 * 8)
    omega = workloads.scenario("natural", 32, model.num_experts, 4096, model.top_k, ranks_per_domain=8, seed=0)
    from topoep.runtime import NetBenefitGuard

    host, gpu = (sim.simulate(omega, cl, model=model, policy=policy, num_slots=2, guard=NetBenefitGuard(),
                              execution=replace(sim.EXECUTIONS["topoep"], peers_on_gpu=on)) for on in (False, True))
    ex = sim.EXECUTIONS["topoep"]
    host_solve = ex.host_round_trip_s + 32 * model.num_experts * 8 / cl.host_bytes_per_s + sim.gpu_planner_s(32)
    assert gpu.terms["plan"] - host.terms["plan"] == pytest.approx(peer_solo_s(policy, 32, 2) - host_solve, abs=1e-12)
    assert gpu.terms["fetch"] == host.terms["fetch"] and gpu.stats["imbalance"] == host.stats["imbalance"]
