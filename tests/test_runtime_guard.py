"""The net-benefit guard (paper eq. 2). CPU unit tests on a hand-worked plan (prediction, selection,
no host synchronisation: the guard runs on meta tensors, which have no values to read), and multi-rank
tests (gloo, 4 ranks as 2 domains x 2): balanced routing makes the guard fire and the layer equal the
static one bit for bit; skewed routing does not, and the layer equals the unguarded one bit for bit.
"""

import pytest
import torch

from distributed import run_ranks
from topoep import ExpertParallelMoE, Plan, Topology, solve
from topoep.runtime import LAYER_STAT_NAMES
from topoep.relay import relay_sources
from topoep.links import chunk_pipeline, pipelined_layer_s
from topoep.runtime.guard import NetBenefitGuard, SlotSkipHint
from topoep.workloads import balanced_topk, biased_routing, biased_topk

IDX = {n: i for i, n in enumerate(LAYER_STAT_NAMES)}


def hand_plan():
    """R=2 (one domain), E=4, 1 slot: rank 0's experts 0 and 1 take all 16 assignments; topoep puts a
    replica of expert 0 on rank 1 and balances 8 / 8."""
    topo = Topology(num_domains=1, ranks_per_domain=2)  # 200 GB/s inside the domain
    omega = torch.tensor([[6, 2, 0, 0], [5, 3, 0, 0]])
    plan = solve(omega, topo, num_slots=1, policy="topoep", expert_bytes=1000, token_bytes=10)
    assert plan.slot_expert.tolist() == [[-1], [0]] and plan.rank_load.tolist() == [8, 8]
    return plan


def test_prediction_and_selection_on_a_hand_worked_plan():
    plan = hand_plan()
    # plan 100 us, 20 us per exposed transfer, the topology's 200 GB/s; 2 token transfers, priced serially
    g = NetBenefitGuard(token_transfers=2, token_overlap=0.0)
    # one replica of 1000 B over 200 GB/s = 5 ns, 3 exposed transfers (backend torch)
    cost = 1e-4 + 3 * (1000 / 200e9 + 2e-5)
    assert g.transfer_time(plan, 3).item() == pytest.approx(3 * (1000 / 200e9 + 2e-5), rel=1e-12)
    # tokens: static sends rank 1's 8 assignments x 10 B to rank 0 (80 B on its port), the plan 3 each way (30 B);
    # 2 token transfers save 2 x 50 B at 200 GB/s
    tokens = 2 * (80 - 30) / 200e9
    assert g.static_dispatch_time(plan).item() == pytest.approx(80 / 200e9, rel=1e-12)
    assert g.dispatch_time(plan).item() == pytest.approx(30 / 200e9, rel=1e-12)
    # t_ffn 1 us: saving 8 assignments x 1 us (+ the tokens) < 160 us -> static plan
    executed, fired, saved, c = g.select(plan, 1e-6, 3)
    assert fired.item() and saved.item() == pytest.approx(8e-6 + tokens, rel=1e-12)
    assert c.item() == pytest.approx(cost)
    assert NetBenefitGuard(token_transfers=0).predict(plan, 1e-6, 3)[0].item() == pytest.approx(8e-6, rel=1e-12)
    static = solve(plan.omega, plan.topology, num_slots=1, policy="static", expert_bytes=1000, token_bytes=10)
    assert torch.equal(executed.slot_expert, static.slot_expert) and torch.equal(executed.route, static.route)
    executed.check()
    # t_ffn 100 us: saving 800 us > 160 us -> the balanced plan, unchanged
    executed, fired, saved, _ = g.select(plan, 1e-4, 3)
    assert not fired.item() and saved.item() == pytest.approx(8e-4 + tokens, rel=1e-12)
    assert torch.equal(executed.slot_expert, plan.slot_expert) and torch.equal(executed.route, plan.route)
    # overlap: X = x + m t - h min(x, m t) for static (x 16 us, t 0.4 ns) and the plan (8 us, 0.15 ns), m 4
    x_s, t_s, x_p, t_p = 16e-6, 80 / 200e9, 8e-6, 30 / 200e9
    for h in (0.0, 0.5, 0.8, 1.0):
        saved_h = NetBenefitGuard(token_overlap=h).predict(plan, 1e-6, 3)[0].item()
        want = (x_s + 4 * t_s - h * min(x_s, 4 * t_s)) - (x_p + 4 * t_p - h * min(x_p, 4 * t_p))
        assert saved_h == pytest.approx(want, rel=1e-12), h
    # the chunk pipeline (token_chunks): X is links.pipelined_layer_s of the same x and t
    for n in (1, 2, 5):
        saved_n = NetBenefitGuard(token_chunks=n).predict(plan, 1e-6, 3)[0].item()
        assert saved_n == pytest.approx(pipelined_layer_s(x_s, t_s, n) - pipelined_layer_s(x_p, t_p, n), rel=1e-12)
    assert NetBenefitGuard(token_chunks=2, token_transfers=0).predict(plan, 1e-6, 3)[0].item() == pytest.approx(8e-6)
    # a slow link moves the decision: 1000 B at 10 B/s = 100 s per transfer
    assert NetBenefitGuard(bytes_per_s=10.0).select(plan, 1e-4, 1)[1].item()
    # no planning cost, one exposed transfer: 8 us saved < 5 ns + 20 us latency; without the latency > 5 ns
    assert NetBenefitGuard(plan_s=0.0).select(plan, 1e-6, 1)[1].item()
    assert not NetBenefitGuard(plan_s=0.0, transfer_latency_s=0.0).select(plan, 1e-6, 1)[1].item()


def test_pipelined_layer_time_by_hand():
    """links.pipelined_layer_s: forward and backward chunk pipelines (paper 3.3), worked by hand."""
    # 1 chunk, x 3 (1 per third), t 1: forward dispatch 1, compute 1, combine 1 = 3; backward dispatch 1, data
    # gradients 1, then the combine (1) beside the weight gradients (1) = 3
    assert pipelined_layer_s(3.0, 1.0, 1) == 6.0
    # 2 chunks of dispatch 0.5, compute 0.5: forward 0.5 + 0.5 + 0.5 + 0.5 = 2.0; backward the same, the weight
    # gradients (1) after the last chunk's data gradients (ends 1.5): 2.5
    assert pipelined_layer_s(3.0, 1.0, 2) == 4.5
    # transfer-bound: the four transfers (4 each) take 16, the compute (0.3) hides behind them
    assert pipelined_layer_s(0.3, 4.0, 2) == 16.0
    # tensors: elementwise, equal to the float schedule
    x, t = torch.tensor([3.0, 0.3, 7.0], dtype=torch.float64), torch.tensor([1.0, 4.0, 0.1], dtype=torch.float64)
    got = pipelined_layer_s(x, t, 3)
    assert got.tolist() == [pipelined_layer_s(a, b, 3) for a, b in zip(x.tolist(), t.tolist())]
    # the simulator's pipeline is the same function
    from topoep_research import sim

    assert sim.pipeline is chunk_pipeline


def test_transfer_times_are_the_busiest_link_of_a_brute_force_count():
    """Two domains of two ranks, NVLink 200 GB/s and NICs 50 GB/s: the replica fetch and the dispatch take their
    busiest link's time, counted here link by link from the plan's instances."""
    topo = Topology(num_domains=2, ranks_per_domain=2)
    g = torch.Generator().manual_seed(5)
    seen_relay = set()
    for trial in range(20):
        omega = torch.randint(0, 50, (4, 8), generator=g)
        omega[:, trial % 8] *= 8 if trial % 2 else 40  # one hot expert (a very hot one: copies on every rank)
        # odd trials: small weights (the direct fetch wins); even: large weights and tokens, a very hot expert with
        # copies on both ranks of the other domain (a relay tree wins: one NIC crossing instead of two)
        W, S = (1000, 10) if trial % 2 else (10 ** 7, 10 ** 4)
        plan = solve(omega, topo, num_slots=2, policy="topoep_plus", expert_bytes=W, token_bytes=S)
        dom = [r // 2 for r in range(4)]
        cost = lambda s, r: 1 / 200e9 if dom[s] == dom[r] else 1 / 50e9  # noqa: E731

        def busiest(flows):  # flows[(s, r)] = bytes
            links = {}
            for (s, r), b in flows.items():
                if s != r:
                    kind = "nvl" if dom[s] == dom[r] else "nic"
                    links[(kind, "out", s)] = links.get((kind, "out", s), 0.0) + b * cost(s, r)
                    links[(kind, "in", r)] = links.get((kind, "in", r), 0.0) + b * cost(s, r)
            return max(links.values(), default=0.0)

        E, N = 8, 2
        fetch, tok, tok_static = {}, {}, {}
        for r in range(4):
            for j in range(N):
                e = int(plan.slot_expert[r, j])
                if e >= 0:
                    m = int(plan.main_rank[e])
                    fetch[(m, r)] = fetch.get((m, r), 0) + W
        for s in range(4):
            for p in range(E + 4 * N):
                r, a = int(plan.instance_rank[p]), int(plan.route[s, p])
                tok[(s, r)] = tok.get((s, r), 0) + S * a
            for e in range(E):
                m = int(plan.main_rank[e])
                tok_static[(s, m)] = tok_static.get((s, m), 0) + S * int(omega[s, e])
        n_rep = bool((plan.slot_expert >= 0).any())
        assert NetBenefitGuard().transfer_time(plan, 3).item() == pytest.approx(
            3 * (busiest(fetch) + 2e-5) if n_rep else 0.0, rel=1e-12)
        # relayed (fanout 1, chains): every level at its busiest link, one latency per level that carries a copy
        source, level = relay_sources(plan, 1)
        per_level = {}
        for r in range(4):
            for j in range(N):
                if int(source[r, j]) >= 0:
                    flows = per_level.setdefault(int(level[r, j]), {})
                    key = (int(source[r, j]), r)
                    flows[key] = flows.get(key, 0) + W
        direct = busiest(fetch) + 2e-5
        # the direct fetch beyond a tree's share: a home sends more than one copy (fanout 1) of an expert into its
        # own domain, or more than one into another domain
        into = {}
        for r in range(4):
            for j in range(N):
                e = int(plan.slot_expert[r, j])
                if e >= 0:
                    into[(e, dom[r])] = into.get((e, dom[r]), 0) + 1
        beyond = any(n > 1 for n in into.values())
        for chunks, share in ((1, False), (3, False), (1, True), (3, True)):  # step s: chunk s - (l - 1) of level l
            L = max(per_level, default=1)
            steps = []
            for st in range(L + chunks - 1):
                flows = {}
                for lv, f in per_level.items():
                    if 0 <= st - (lv - 1) < chunks:
                        for key, b in f.items():
                            flows[key] = flows.get(key, 0) + b
                steps.append(flows)
            relayed = sum(busiest(f) for f in steps) / chunks + 2e-5 * sum(1 for f in steps if f)
            t, relay = NetBenefitGuard(relay_fanout=1, relay_chunks=chunks, relay_share=share).fetch_choice(plan, 3)
            relayed_kept = relayed < direct or (share and beyond)  # relay_share: never beyond a tree's share
            assert t.item() == pytest.approx(3 * (relayed if relayed_kept else direct) if n_rep else 0.0, rel=1e-12)
            assert bool(relay) == (n_rep and relayed_kept)
            seen_relay.add((relayed < direct, beyond))
        assert NetBenefitGuard().dispatch_time(plan).item() == pytest.approx(busiest(tok), rel=1e-12)
        assert NetBenefitGuard().static_dispatch_time(plan).item() == pytest.approx(busiest(tok_static), rel=1e-12)
    # both choices by time occur over these plans, and the share rule relays a fetch the direct one would win
    assert {faster for faster, _ in seen_relay} == {False, True} and (False, True) in seen_relay


def test_worth_planning_skips_only_where_no_plan_can_pay():
    """worth_planning False => the guard fires on every policy's plan (no plan's compute saving pays for planning
    and a replica), over routing from uniform to skewed; it is True where a plan does pay; 1 rank: False."""
    from topoep.workloads import biased_routing

    topo = Topology(num_domains=2, ranks_per_domain=4)
    g = NetBenefitGuard(token_transfers=0)
    seen = set()
    for skew in (0.0, -0.5, -1.0, -2.0, -4.0):
        for seed in range(3):
            omega = biased_routing(8, 32, 256, 4, skew, seed=seed)
            for t_ffn in (1e-7, 1e-6, 1e-5):
                worth = g.worth_planning(omega, topo, torch.arange(32) // 4, t_ffn, 10_000, 3)
                seen.add(bool(worth))
                for policy in ("topoep", "topoep_plus", "deepseek", "flexmoe"):
                    plan = solve(omega, topo, num_slots=2, policy=policy, expert_bytes=10_000, token_bytes=10)
                    saved, cost = g.predict(plan, t_ffn, 3)
                    if not worth:
                        assert saved.item() <= cost.item(), (skew, seed, t_ffn, policy)
    assert seen == {True, False}
    one = Topology(num_domains=1, ranks_per_domain=1)
    assert not g.worth_planning(torch.tensor([[5, 0]]), one, torch.zeros(2, dtype=torch.int64), 1.0, 1, 3).item()


def test_solve_enable_false_plans_nothing():
    """solve(enable=False) returns the static plan under the policy's name without running the policy."""
    from unittest import mock

    from topoep.planners import reference

    plan = hand_plan()
    static = solve(plan.omega, plan.topology, num_slots=1, policy="static", expert_bytes=1000, token_bytes=10)
    with mock.patch.object(reference, "solve_topoep", side_effect=AssertionError("the planner ran")) as planner:
        got = solve(plan.omega, plan.topology, num_slots=1, policy="topoep", expert_bytes=1000, token_bytes=10,
                    enable=torch.tensor(False))
    assert planner.call_count == 0
    assert got.policy == "topoep" and torch.equal(got.route, static.route)
    assert torch.equal(got.slot_expert, static.slot_expert)
    got = solve(plan.omega, plan.topology, num_slots=1, policy="topoep", expert_bytes=1000, token_bytes=10,
                enable=torch.tensor(True))
    assert torch.equal(got.route, plan.route)
    with pytest.raises(ValueError, match="enable must be None or a 0-d bool tensor"):
        solve(plan.omega, plan.topology, num_slots=1, enable=True)


def test_select_keeps_the_candidate_with_the_largest_net_saving():
    """Two domains of four (NVLink 200 GB/s, NICs 50 GB/s), skewed routing, Qwen3-sized experts: topoep_plus and
    its local candidate differ; the guard keeps the one whose predicted T_saved - T_plan - T_transfer is larger (its
    index in info["guard_choice"]), ties to the earlier, and the static plan when neither pays."""
    from topoep.workloads import biased_routing

    topo = Topology(num_domains=2, ranks_per_domain=4)
    om = biased_routing(8, 32, 512, 4, -3.0, seed=2)
    kw = dict(num_slots=2, expert_bytes=9_437_184, token_bytes=4096)
    plus = solve(om, topo, policy="topoep_plus", **kw)
    local = solve(om, topo, policy="topoep_plus_local", **kw)
    assert not torch.equal(plus.route, local.route)
    seen = set()
    for g in (NetBenefitGuard(), NetBenefitGuard(token_overlap=0.0), NetBenefitGuard(bytes_per_s=1e9)):
        for t_ffn in (1e-9, 1e-6, 1e-5):  # with the defaults: neither pays, the local plan, topoep_plus
            nets = [float(a - b) for a, b in (g.predict(p, t_ffn, 3) for p in (plus, local))]
            executed, fired, saved, cost = g.select(plus, t_ffn, 3, candidates=(local,))
            best = 0 if nets[0] >= nets[1] else 1
            seen.add((best, max(nets) > 0))
            assert int(executed.info["guard_choice"]) == best
            assert float(saved - cost) == max(nets)
            want = (plus, local)[best] if max(nets) > 0 else solve(om, topo, policy="static", **kw)
            assert bool(fired) == (max(nets) <= 0)
            assert torch.equal(executed.route, want.route) and torch.equal(executed.slot_expert, want.slot_expert)
    assert {b for b, pays in seen if pays} == {0, 1} and (False in {pays for _, pays in seen}), seen
    executed = NetBenefitGuard().select(plus, 1e-5, 3, candidates=(plus,))[0]
    assert int(executed.info["guard_choice"]) == 0  # a tie keeps the earlier
    small = solve(om[:, :16].contiguous()[:4], Topology(num_domains=1, ranks_per_domain=4), **kw)
    with pytest.raises(ValueError, match="guard candidates must have the plan's shapes"):
        NetBenefitGuard().select(plus, 1e-5, 3, candidates=(small,))


def test_allow_false_forces_the_static_plan():
    """The host left the replica machinery out: the static plan runs even where the guard wants replicas."""
    plan = hand_plan()
    g = NetBenefitGuard()
    static = solve(plan.omega, plan.topology, num_slots=1, policy="static", expert_bytes=1000, token_bytes=10)
    executed, fired, saved, cost = g.select(plan, 1e-4, 3, torch.tensor(False))
    assert fired.item() and (saved > cost).item()  # forced, although the guard itself wants the plan
    assert torch.equal(executed.slot_expert, static.slot_expert) and torch.equal(executed.route, static.route)
    executed, fired, _, _ = g.select(plan, 1e-4, 3, torch.tensor(True))
    assert not fired.item() and torch.equal(executed.route, plan.route)


def test_slot_skip_hint_follows_the_decision_lag_calls_back():
    for lag in (1, 2, 3):
        hint = SlotSkipHint(lag)
        wanted = [True, False, False, True, False, True, True, False, False, False]
        got = []
        for w in wanted:
            got.append(hint.allow(torch.device("cpu")))
            hint.record(torch.tensor(w))
        assert got == [True] * lag + wanted[:-lag], (lag, got)
        assert hint.skipped == got.count(False) and hint.calls == len(wanted) and hint.waits == 0
    with pytest.raises(ValueError, match="skip_lag must be an integer >= 1"):
        NetBenefitGuard(skip_lag=0)
    topo = Topology(num_domains=1, ranks_per_domain=1)
    # backend torch reads its sizes on the host anyway: no hint there
    assert ExpertParallelMoE(num_experts=4, hidden_size=8, ffn_hidden_size=4, topology=topo).slot_hint is None


def test_guard_reads_no_tensor_values():
    """No host synchronisation: every input on the meta device, where reading a value raises."""
    p = hand_plan()
    meta = Plan(omega=p.omega.to("meta"), topology=p.topology, num_slots=1, main_rank=p.main_rank.to("meta"),
                slot_expert=p.slot_expert.to("meta"), route=p.route.to("meta"), policy="topoep",
                expert_bytes=1000, token_bytes=10)
    executed, fired, saved, cost = NetBenefitGuard().select(meta, 1e-6, 3)
    assert executed.route.is_meta and executed.route.shape == p.route.shape and fired.shape == ()
    executed = NetBenefitGuard(relay_fanout=2).select(meta, 1e-6, 3, candidates=(meta,))[0]  # the kept candidate
    assert executed.route.is_meta and executed.info["guard_choice"].shape == () and executed.info["relay"].is_meta
    assert NetBenefitGuard(bytes_per_s=1e9).transfer_time(meta, 3).is_meta
    assert NetBenefitGuard(relay_fanout=2).transfer_time(meta, 3).is_meta
    worth = NetBenefitGuard().worth_planning(meta.omega, meta.topology, meta.main_rank, 1e-6, 1000, 3)
    assert worth.is_meta and worth.dtype == torch.bool and worth.shape == ()


def test_layer_guard_prices_its_serial_execution():
    """A layer's own guard (LayerConfig.guard) prices its dispatch, compute and combine serially
    (SERIAL_TOKEN_OVERLAP); a NetBenefitGuard passed to the layer keeps its constants."""
    from topoep.runtime.guard import SERIAL_TOKEN_OVERLAP

    topo = Topology(num_domains=1, ranks_per_domain=1)
    layer = ExpertParallelMoE(num_experts=4, hidden_size=8, ffn_hidden_size=4, topology=topo, guard=True)
    assert SERIAL_TOKEN_OVERLAP == 0.0 and layer.guard.token_overlap == SERIAL_TOKEN_OVERLAP
    own = NetBenefitGuard(token_overlap=0.5)
    assert ExpertParallelMoE(num_experts=4, hidden_size=8, ffn_hidden_size=4, topology=topo, guard=own).guard == own


def test_fetch_overlap_prices_what_the_forward_waits_for():
    """fetch_overlap on the hand-worked plan (one chunk: dispatch, expert rows, combine): rank 1 holds only the replica,
    so its rows start when the fetch ends; the dispatch ran before them, so the forward waits the fetch less one
    dispatch. The other exposed transfers keep their whole time; a plan without replicas costs the plan time only."""
    plan = hand_plan()
    assert plan.route[:, 4:].sum().item() == 8 and plan.route[1, 2:4].sum().item() == 0  # rank 1: 8 rows, all slot
    g = NetBenefitGuard(token_transfers=2, token_overlap=0.0)
    t_rep = 1000 / 200e9 + 2e-5  # one fetch, latency included
    t_disp = 30 / 200e9  # one dispatch of the plan
    for n in (1, 3):
        cost = NetBenefitGuard(token_transfers=2, token_overlap=0.0, fetch_overlap=True).predict(plan, 1e-6, n)[1]
        assert cost.item() == pytest.approx(1e-4 + (n - 1) * t_rep + (t_rep - t_disp), rel=1e-9)
        assert cost.item() < g.predict(plan, 1e-6, n)[1].item()
    # no exposed transfer, or no replica: nothing to wait for
    assert NetBenefitGuard(fetch_overlap=True).predict(plan, 1e-6, 0)[1].item() == pytest.approx(1e-4)
    static = solve(plan.omega, plan.topology, num_slots=1, policy="static", expert_bytes=1000, token_bytes=10)
    assert NetBenefitGuard(fetch_overlap=True).predict(static, 1e-6, 3)[1].item() == pytest.approx(1e-4)
    # the layer's guard prices the overlap its backend runs
    topo = Topology(num_domains=1, ranks_per_domain=1)
    assert not ExpertParallelMoE(num_experts=4, hidden_size=8, ffn_hidden_size=4, topology=topo).guard.fetch_overlap


@pytest.mark.parametrize("chunks", [None, 2])
def test_fetch_overlap_waits_at_most_the_fetch_and_its_stretch(chunks):
    """On random routings (2 domains of 4 ranks, 2 slots, relayed or direct fetches): the forward's wait for an
    overlapped fetch is never negative and never more than the fetch itself plus what its bytes add to the busiest
    link the dispatch shares with it; so fetch_overlap's cost lies between (n - 1) T_fetch and n T_fetch + that."""
    topo = Topology(num_domains=2, ranks_per_domain=4)
    for seed in range(6):
        omega = biased_routing(8, 64, 512, 4, -3.0, seed=seed)
        for policy in ("topoep_plus", "topoep"):
            plan = solve(omega, topo, num_slots=2, policy=policy, expert_bytes=1 << 20, token_bytes=4096)
            if not (plan.slot_expert >= 0).any():
                continue
            for fanout in (None, 2):
                g = NetBenefitGuard(token_chunks=chunks, relay_fanout=fanout)
                t_fetch = g.transfer_time(plan, 1).item()
                plain = g.predict(plan, 1e-7, 3)[1].item() - g.plan_s
                over = NetBenefitGuard(token_chunks=chunks, relay_fanout=fanout,
                                       fetch_overlap=True).predict(plan, 1e-7, 3)[1].item() - g.plan_s
                assert plain == pytest.approx(3 * t_fetch, rel=1e-12)
                assert 2 * t_fetch - 1e-15 <= over <= 3 * t_fetch + t_fetch, (seed, policy, fanout)


def test_bad_guard_arguments():
    for kw, match in [(dict(plan_s=-1.0), "plan_s"), (dict(transfer_latency_s=float("inf")), "transfer_latency_s"),
                      (dict(bytes_per_s=0), "bytes_per_s"), (dict(exposed_transfers=-1), "exposed_transfers"),
                      (dict(token_transfers=1.5), "token_transfers"), (dict(token_transfers=-1), "token_transfers"),
                      (dict(token_top_k=0), "token_top_k"), (dict(token_top_k=True), "token_top_k"),
                      (dict(relay_fanout=0), "relay_fanout"),
                      (dict(token_overlap=1.5), "token_overlap"), (dict(token_overlap=None), "token_overlap"),
                      (dict(token_chunks=0), "token_chunks"), (dict(token_chunks=65), "token_chunks"),
                      (dict(token_chunks=2.0), "token_chunks"),
                      (dict(token_chunks=2, token_transfers=2), "token_transfers must be 4"),
                      (dict(fetch_overlap=1), "fetch_overlap")]:
        with pytest.raises(ValueError, match=match):
            NetBenefitGuard(**kw)
    topo = Topology(num_domains=1, ranks_per_domain=1)
    with pytest.raises(ValueError, match="LayerConfig.guard must be true or false, got 'on'"):
        ExpertParallelMoE(num_experts=4, hidden_size=8, ffn_hidden_size=4, topology=topo, guard="on")
    with pytest.raises(ValueError, match="LayerConfig.t_ffn must be a positive"):
        ExpertParallelMoE(num_experts=4, hidden_size=8, ffn_hidden_size=4, topology=topo, t_ffn=0.0)


def _harness(rank, topo, Fd, seed):
    """(layer(policy, guard, t_ffn), run(layer, idx)) for the 4-rank guard tests: E = 16 experts of hidden 8 and ffn
    Fd, 64 tokens of top-2 per rank, weights and inputs from `seed`; run returns the output and every gradient."""
    E, T, k, H = 16, 64, 2, 8
    g = torch.Generator().manual_seed(seed)
    fc1 = torch.randn(E, 2 * Fd, H, generator=g) * 0.2
    fc2 = torch.randn(E, H, Fd, generator=g) * 0.2
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(10 * seed + rank))
    w = torch.softmax(torch.randn(T, k, generator=torch.Generator().manual_seed(10 * seed + 5 + rank)), -1)
    lo, hi = rank * 4, rank * 4 + 4

    def layer(policy, guard, t_ffn, **kw):
        m = ExpertParallelMoE(num_experts=E, hidden_size=H, ffn_hidden_size=Fd, topology=topo, num_slots=2,
                              policy=policy, t_ffn=t_ffn, guard=guard, **kw)
        with torch.no_grad():
            m.fc1.copy_(fc1[lo:hi])
            m.fc2.copy_(fc2[lo:hi])
        return m

    def run(m, idx):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = m(xr, idx, wr)
        y.backward(torch.ones_like(y))
        return [y.detach(), xr.grad, wr.grad, m.fc1.grad.clone(), m.fc2.grad.clone()]

    return layer, run


def _guarded_layers(rank, world):
    topo = Topology(num_domains=2, ranks_per_domain=2)
    E, T, k = 16, 64, 2
    workloads = {"balanced": balanced_topk(world, E, T, k)[rank],
                 "skewed": biased_topk(world, E, T, k, -4.0, seed=1, layout="concentrated")[rank]}
    # t_ffn 1 us per assignment: the saving of a skewed plan (hundreds of assignments) beats the default 100 us
    # planning estimate; a balanced one saves nothing
    make, run = _harness(rank, topo, 4, 3)

    def layer(policy, guard):
        return make(policy, guard, 1e-6)

    guarded, out = layer("topoep", True), {}
    for name, idx in workloads.items():
        guarded.zero_grad(set_to_none=True)
        res = run(guarded, idx)
        s = guarded.stats_dict()
        ref = run(layer("static" if name == "balanced" else "topoep", False), idx)
        out[name] = dict(fired=s["guard_fired"], replicas=s["num_replicas"], saved=s["guard_saved_ms"],
                         cost=s["guard_cost_ms"], wanted=s["guard_wanted"],
                         skip=(s["slot_skipped"], s["slot_skip_missed"]), plan_skipped=s["plan_skipped"],
                         bit_equal=all(torch.equal(a, b) for a, b in zip(res, ref)))
    unguarded = layer("topoep", False)
    run(unguarded, workloads["skewed"])
    out["unguarded_replicas"] = unguarded.stats_dict()["num_replicas"]
    run(guarded, workloads["balanced"])  # 3 calls since the last pop: balanced, skewed, balanced
    stats, calls = guarded.pop_stats()
    out["pop"] = (stats[IDX["guard_fired"]].item() * calls, calls)
    return out


def test_balanced_routing_fires_the_guard_and_skewed_routing_does_not():
    results = run_ranks(_guarded_layers, 4)
    for r in results:
        bal, skew = r["balanced"], r["skewed"]
        # (nothing planned: nothing priced, saved = cost = 0)
        assert bal["fired"] == 1.0 and bal["replicas"] == 0 and bal["saved"] == 0.0 and bal["cost"] == 0.0
        assert bal["bit_equal"], "guard fired: the layer must compute exactly what the static layer computes"
        assert skew["fired"] == 0.0 and skew["replicas"] > 0 and skew["saved"] > skew["cost"]
        assert skew["bit_equal"], "guard did not fire: the layer must compute exactly what it computes unguarded"
        assert r["unguarded_replicas"] == skew["replicas"]
        assert (bal["wanted"], skew["wanted"]) == (0.0, 1.0)  # the guard's own decision
        # balanced routing: no plan can save compute, so planning was left out (worth_planning); skewed: planned
        assert (bal["plan_skipped"], skew["plan_skipped"]) == (1.0, 0.0)
        assert bal["skip"] == skew["skip"] == (0.0, 0.0)  # backend torch never leaves the replicas out
        assert r["pop"] == (pytest.approx(2.0), 3)  # fired in 2 of 3 calls
    assert len({(r["skewed"]["replicas"], r["balanced"]["fired"]) for r in results}) == 1  # one decision


def _plus_candidates(rank, world):
    """Guarded topoep_plus layers on 4 ranks (2 domains of 2): each call executes whichever of topoep_plus and its
    local plan the guard kept, bit for bit as an unguarded layer of that policy computes it."""
    # NICs at 100 MB/s: a copy of these small experts (6 KiB) across domains costs about what Qwen3's does on RDMA
    topo = Topology(num_domains=2, ranks_per_domain=2, inter_cost=1e-8)
    E, T, k = 16, 64, 2
    layer, run = _harness(rank, topo, 64, 4)

    out = []
    cheap, dear = NetBenefitGuard(plan_s=0.0, transfer_latency_s=0.0), NetBenefitGuard(plan_s=1.0)
    # the local plan pays more (cheap NVLink copies), topoep_plus pays more (expert time dominates), nothing pays
    for guard, t_ffn in ((cheap, 1e-6), (cheap, 1e-4), (dear, 1e-6)):
        idx = biased_topk(world, E, T, k, -3.0, seed=3, layout="clustered")[rank]
        guarded = layer("topoep_plus", guard, t_ffn)
        res = run(guarded, idx)
        s = guarded.stats_dict()
        chosen = int(guarded.last_plan.info["guard_choice"]) if "guard_choice" in guarded.last_plan.info else None
        local = s["plan_local"] == 1.0
        ref = run(layer("static" if s["guard_fired"] else ("topoep_plus_local" if local else "topoep_plus"), False,
                        t_ffn), idx)
        out.append(dict(fired=s["guard_fired"], local=local, chosen=chosen,
                        bit_equal=all(torch.equal(a, b) for a, b in zip(res, ref))))
    return out


def test_guarded_topoep_plus_executes_the_kept_candidate():
    results = run_ranks(_plus_candidates, 4)
    for r in results:
        assert all(c["bit_equal"] for c in r), r
        assert all(c["local"] == (c["chosen"] == 1 and not c["fired"]) for c in r), r
    assert len({tuple((c["fired"], c["local"]) for c in r) for r in results}) == 1  # every rank decided alike
    assert [(c["fired"], c["local"]) for c in results[0]] == [(0.0, True), (0.0, False), (1.0, False)]


def _spread_candidate(rank, world):
    """Guarded topoep_plus layers on 4 ranks (2 domains of 2, NICs at 100 MB/s) on megatron's random bias, where the
    guard prefers the spread plan: with plus_spread (and no spread gate: the planner on every call) it executes it, bit
    for bit as an unguarded topoep_plus_spread layer; without, it keeps one of its two own plans."""
    topo = Topology(num_domains=2, ranks_per_domain=2, inter_cost=1e-8)
    layer, run = _harness(rank, topo, 64, 4)
    idx = biased_topk(world, 16, 64, 2, -4.0, seed=0)[rank]
    cheap = NetBenefitGuard(plan_s=0.0, transfer_latency_s=0.0)
    out = {}
    for spread in (True, False):
        guarded = layer("topoep_plus", cheap, 1e-5, plus_spread=spread, spread_gate=False)
        res = run(guarded, idx)
        s = guarded.stats_dict()
        ref = run(layer("topoep_plus_spread" if spread else ("topoep_plus_local" if s["plan_local"] else "topoep_plus"),
                        False, 1e-5), idx)
        out[spread] = dict(fired=s["guard_fired"], spread=s["plan_spread"], local=s["plan_local"],
                           planned=s["spread_planned"],
                           choice=int(guarded.last_plan.info["guard_choice"]),
                           bit_equal=all(torch.equal(a, b) for a, b in zip(res, ref)))
    return out


def test_guarded_topoep_plus_executes_its_spread_candidate():
    results = run_ranks(_spread_candidate, 4)
    for r in results:
        assert r[True]["bit_equal"] and r[False]["bit_equal"], r
        assert (r[True]["fired"], r[True]["spread"], r[True]["choice"]) == (0.0, 1.0, 2), r
        assert r[True]["planned"] == 1.0 and r[False]["planned"] == 0.0, r
        assert r[False]["spread"] == 0.0 and r[False]["choice"] in (0, 1), r
    assert len({repr(r) for r in results}) == 1  # every rank decided alike


def _peer_candidates(rank, world):
    """Guarded topoep_plus layers with plus_peers on 4 ranks (2 domains of 2, NICs at 100 MB/s), on two routings where
    the guard's per-link model prefers a peer's plan: FlexMoE's (clustered hot experts, expert time dominating) and
    DeepSeek EPLB's (scattered ones, cheap experts). Each call executes the kept plan bit for bit as an unguarded layer
    of that policy computes it; with plus_spread as well the spread candidates come after the peers'."""
    topo = Topology(num_domains=2, ranks_per_domain=2, inter_cost=1e-8)
    layer, run = _harness(rank, topo, 64, 4)
    cheap = NetBenefitGuard(plan_s=0.0, transfer_latency_s=0.0)
    out = []
    for layout, skew, t_ffn in (("clustered", -4.0, 1e-4), ("scattered", -2.0, 1e-6)):
        idx = biased_topk(world, 16, 64, 2, skew, seed=0, layout=layout)[rank]
        for spread in (False, True):
            guarded = layer("topoep_plus", cheap, t_ffn, plus_peers=True, plus_spread=spread, spread_gate=False)
            res = run(guarded, idx)
            s = guarded.stats_dict()
            choice = int(guarded.last_plan.info["guard_choice"])
            names = guarded._plus_policies()
            ref = run(layer(names[choice] if not s["guard_fired"] else "static", False, t_ffn), idx)
            out.append(dict(names=names, choice=choice, fired=s["guard_fired"], peer=s["plan_peer"],
                            spread=s["plan_spread"], local=s["plan_local"],
                            bit_equal=all(torch.equal(a, b) for a, b in zip(res, ref))))
    return out


def test_guarded_topoep_plus_executes_a_peer_candidate():
    results = run_ranks(_peer_candidates, 4)
    for r in results:
        assert all(c["bit_equal"] for c in r), r
        assert [c["names"] for c in r[:2]] == [
            ("topoep_plus", "topoep_plus_local", "flexmoe", "deepseek"),
            ("topoep_plus", "topoep_plus_local", "flexmoe", "deepseek", "topoep_plus_spread")]
        # the peer's plan is kept on both routings (without and with the spread candidate beside it)
        assert [(c["fired"], c["choice"], c["peer"], c["spread"], c["local"]) for c in r] == [
            (0.0, 2, 1.0, 0.0, 0.0), (0.0, 2, 1.0, 0.0, 0.0), (0.0, 3, 1.0, 0.0, 0.0), (0.0, 3, 1.0, 0.0, 0.0)], r
    assert len({repr(r) for r in results}) == 1  # every rank decided alike


def _peer_gate(rank, world):
    """The flexmoe routing of _peer_candidates over 4 calls with the spread gate on (probe period 3): a peers' planner
    that costs more than any plan saves (spread_plan_s 1 s) runs on the probe (call 2) only, and the calls around it
    execute what the layer without plus_peers executes, bit for bit; a free one (0 s), whose plan the guard keeps,
    runs on every call from the second."""
    topo = Topology(num_domains=2, ranks_per_domain=2, inter_cost=1e-8)
    layer, run = _harness(rank, topo, 64, 4)
    idx = biased_topk(world, 16, 64, 2, -4.0, seed=0, layout="clustered")[rank]
    out = {}
    for name, spread_s, peers in (("slow", 1.0, True), ("free", 0.0, True), ("without", None, False)):
        guard = NetBenefitGuard(plan_s=0.0, transfer_latency_s=0.0, spread_plan_s=spread_s)
        m = layer("topoep_plus", guard, 1e-4, plus_peers=peers, spread_probe=3)
        calls = []
        for _ in range(4):
            m.zero_grad(set_to_none=True)
            res = run(m, idx)
            s = m.stats_dict()
            calls.append(dict(res=res, state=(s["spread_planned"], s["plan_peer"], int(m.last_plan.info["guard_choice"]))))
        out[name] = calls
    same = [all(torch.equal(a, b) for a, b in zip(c["res"], w["res"])) for c, w in zip(out["slow"], out["without"])]
    return {k: [c["state"] for c in v] for k, v in out.items()} | {"slow_as_without": same}


def test_spread_gate_runs_the_peers_planners_where_they_pay():
    results = run_ranks(_peer_gate, 4)
    for r in results:
        # (spread_planned, plan_peer, the guard's choice) per call: FlexMoE's plan (choice 2) where the peers ran
        assert r["slow"] == [(0.0, 0.0, 0), (1.0, 1.0, 2), (0.0, 0.0, 0), (0.0, 0.0, 0)], r
        assert r["free"] == [(0.0, 0.0, 0)] + [(1.0, 1.0, 2)] * 3, r
        assert r["without"] == [(0.0, 0.0, 0)] * 4, r
        assert [same for i, same in enumerate(r["slow_as_without"]) if i != 1] == [True] * 3, r
    decisions = [{k: v for k, v in r.items() if k != "slow_as_without"} for r in results]
    assert len({repr(d) for d in decisions}) == 1  # every rank decided alike


def test_plus_peers_needs_the_guarded_topoep_plus_layer():
    from topoep import LayerConfig

    assert LayerConfig(policy="topoep_plus", plus_peers=True).plus_peers
    for bad in (dict(policy="topoep"), dict(policy="topoep_plus", guard=False), dict(policy="topoep_plus", num_slots=0)):
        with pytest.raises(ValueError, match="plus_peers=true adds candidates"):
            LayerConfig(plus_peers=True, **bad)
    with pytest.raises(ValueError, match="plus_peers must be true or false"):
        LayerConfig(policy="topoep_plus", plus_peers="yes")


def _spread_gate(rank, world):
    """The spread candidate's layer of _spread_candidate over 7 calls on the same routing, with the spread gate
    (LayerConfig.spread_gate, probe period 3). The first call runs without the spread planner, the second probes it.
    A spread planner that costs more than any plan saves (spread_plan_s 1 s) then runs on the probes only (calls 2
    and 5), and the calls between execute what the layer without plus_spread executes, bit for bit; a free one (0 s),
    whose plan the guard keeps, runs on every call from the second but the probe that measures the other plans again
    (call 5); with the gate off it runs on every call."""
    topo = Topology(num_domains=2, ranks_per_domain=2, inter_cost=1e-8)
    layer, run = _harness(rank, topo, 64, 4)
    idx = biased_topk(world, 16, 64, 2, -4.0, seed=0)[rank]
    out = {}
    for name, spread_s, kw in (("slow", 1.0, {}), ("free", 0.0, {}), ("off", 1.0, dict(spread_gate=False)),
                               ("without", None, dict(plus_spread=False))):
        guard = NetBenefitGuard(plan_s=0.0, transfer_latency_s=0.0, spread_plan_s=spread_s)
        m = layer("topoep_plus", guard, 1e-5, **{"plus_spread": True, "spread_probe": 3, **kw})
        calls = []
        for _ in range(7):
            m.zero_grad(set_to_none=True)
            res = run(m, idx)
            s = m.stats_dict()
            calls.append(dict(res=res, planned=s["spread_planned"], spread=s["plan_spread"],
                              choice=int(m.last_plan.info["guard_choice"])))
        out[name] = calls
    same = [all(torch.equal(a, b) for a, b in zip(c["res"], w["res"])) for c, w in zip(out["slow"], out["without"])]
    return {k: [(c["planned"], c["spread"], c["choice"]) for c in v] for k, v in out.items()} | {"slow_as_without": same}


def test_spread_gate_runs_the_spread_planner_where_it_pays():
    results = run_ranks(_spread_gate, 4)
    for r in results:
        for name, runs in (("slow", (1, 4)), ("free", (1, 2, 3, 5, 6)), ("off", range(7))):
            assert [c[0] for c in r[name]] == [float(i in runs) for i in range(7)], (name, r)
            assert all(c[1:] == (1.0, 2) for i, c in enumerate(r[name]) if i in runs), (name, r)  # the guard keeps it
            assert all(c[1] == 0.0 and c[2] in (0, 1) for i, c in enumerate(r[name]) if i not in runs), (name, r)
        assert all(same for i, same in enumerate(r["slow_as_without"]) if i not in (1, 4)), r
        assert all(c[0] == 0.0 for c in r["without"]), r
    decisions = [{k: v for k, v in r.items() if k != "slow_as_without"} for r in results]
    assert len({repr(d) for d in decisions}) == 1  # every rank decided alike


def test_spread_gate_state():
    """SpreadGate by hand (probe period 2): the first call runs without the spread planner and the second probes it;
    a probe whose kept spread plan beats the other plans' net saving by more than spread_s turns it on; a call without
    it while on (the next probe) keeps it on only while the spread plan still beats that call's by as much; calls the
    pre-plan bound leaves out change nothing."""
    from topoep.runtime.guard import SpreadGate

    yes, no = torch.tensor(True), torch.tensor(False)

    def f(v):
        return torch.tensor(v, dtype=torch.float64)

    def call(gate, worth, fired, saved, cost, choice):
        ran = gate.enable(worth)
        gate.record(worth, ran, fired, f(saved), f(cost), torch.tensor(choice), 2)
        return bool(ran)

    gate = SpreadGate(probe=2, spread_s=1.0)
    assert not call(gate, no, yes, 0.0, 0.0, 0)  # left out: nothing changes
    assert not call(gate, yes, no, 5.0, 1.0, 0)  # the first call: the other plans' net 4
    assert call(gate, yes, no, 9.0, 1.0, 2)  # the probe: spread kept, net 8 beats 4 by more than 1: on
    assert gate.state[0] == 1 and gate.state[3] == 8.0
    assert call(gate, yes, no, 9.0, 1.0, 2)  # on: it runs (net 8 again)
    assert not call(gate, yes, no, 6.0, 1.0, 0)  # the probe, without it: 8 still beats this call's 5 by more than 1
    assert gate.state[0] == 1 and gate.state[2] == 5.0
    assert call(gate, yes, no, 6.5, 1.0, 3)  # on: it runs; kept (the tree candidate), net 5.5 beats 5 by only 0.5
    assert gate.state[0] == 0
    assert call(gate, yes, yes, 9.0, 1.0, 2)  # the probe: the guard fired (static runs): it stays off
    assert gate.state[0] == 0 and gate.state[3] == -float("inf")
    assert not call(gate, yes, no, 6.0, 1.0, 0)  # off: no run until the next probe
    with pytest.raises(ValueError, match="probe period must be an integer >= 2"):
        SpreadGate(probe=1, spread_s=1.0)


def test_spread_plan_s():
    with pytest.raises(ValueError, match="spread_plan_s must be None"):
        NetBenefitGuard(spread_plan_s=-1.0)
    assert NetBenefitGuard(spread_plan_s=2e-4).spread_s(32, False) == 2e-4
    from topoep.planners.spread import LATENCY_SET_US, LATENCY_US

    assert NetBenefitGuard().spread_s(32, False) == pytest.approx(dict(LATENCY_US)[32] * 1e-6)
    assert NetBenefitGuard().spread_s(32, True) == pytest.approx(dict(LATENCY_SET_US)[32] * 1e-6)


def test_plus_spread_needs_the_guarded_topoep_plus_layer():
    from topoep import LayerConfig

    assert LayerConfig(policy="topoep_plus", plus_spread=True).plus_spread
    for bad in (dict(policy="topoep"), dict(policy="topoep_plus", guard=False), dict(policy="topoep_plus", num_slots=0)):
        with pytest.raises(ValueError, match="plus_spread=true adds candidates"):
            LayerConfig(plus_spread=True, **bad)
    with pytest.raises(ValueError, match="plus_spread must be true or false"):
        LayerConfig(policy="topoep_plus", plus_spread=1)


def test_spread_gate_kernel_equals_its_reference_in_the_interpreter():
    """topoep.runtime.gate_triton's kernel under Triton's interpreter against SpreadGate.record_reference
    (tests/gate_check.py: 4 cases x 60 random calls, state and flag equal after each)."""
    from interpreter import interpreted_cases

    cases = interpreted_cases("gate_check.py")
    assert len(cases) == 4 and all("60 calls equal" in c for c in cases), cases
    assert all(" on after 0," not in c and " runs 0" not in c for c in cases), cases  # both states exercised


def test_the_pre_plan_bound_prices_the_fetch_as_the_guard_does():
    """worth_planning's threshold takes the cheapest link in the guard's integer femtoseconds (300 GB/s: 3333 fs per
    byte, not 3333.33), so a plan the guard would keep is never left unplanned: here the bound is 3e-5 below the
    fetch's float cost, and the guard keeps the plan."""
    from topoep.plan import default_main_rank

    topo = Topology(num_domains=1, ranks_per_domain=2, intra_cost=1 / 300e9)
    assert int(topo.cost_fs[0, 1]) == 3333
    omega = torch.tensor([[40, 0, 0, 0], [0, 0, 0, 0]])
    W = 2**30
    g = NetBenefitGuard(plan_s=0.0, transfer_latency_s=0.0, token_transfers=0)
    t_ffn = W / 300e9 / 20 * (1 - 3e-5)  # the bound t_ffn x (40 - 20) just under W x the float cost
    plan = solve(omega, topo, num_slots=1, policy="topoep", expert_bytes=W, token_bytes=10)
    fired = g.select(plan, t_ffn, 1)[1]
    assert not bool(fired)  # the guard keeps the plan ...
    assert bool(g.worth_planning(omega, topo, default_main_rank(4, 2, omega.device), t_ffn, W, 1))  # ... so it plans


def test_a_bandwidth_too_slow_for_the_integer_costs_is_refused():
    with pytest.raises(ValueError, match="NetBenefitGuard.bytes_per_s must be a number of bytes/s above 0.11"):
        NetBenefitGuard(bytes_per_s=0.1)
    NetBenefitGuard(bytes_per_s=10.0)


def _plan_domain_layers(rank, world):
    """Guarded topoep_plus layers on 4 ranks as ONE NVLink domain of 4: with plan_domain=2 the planners see 2 groups
    of 2, so the layer plans topoep_plus and its local plan on the groups (as `solve(..., plan_domain=2)` does) and the
    guard keeps one; without grouping (plan_domain=null) the domain is whole and there is no local plan."""
    topo = Topology(num_domains=1, ranks_per_domain=4)
    layer, run = _harness(rank, topo, 64, 5)
    idx = biased_topk(world, 16, 64, 2, -3.0, seed=3, layout="clustered")[rank]
    cheap = NetBenefitGuard(plan_s=0.0, transfer_latency_s=0.0)
    out = {}
    for pd in (2, None):
        guarded = layer("topoep_plus", cheap, 1e-5, plan_domain=pd, capacity_factor=None)  # (no capacity step)
        res = run(guarded, idx)
        s, plan = guarded.stats_dict(), guarded.last_plan
        kept = "topoep_plus_local" if s["plan_local"] else "topoep_plus"
        ref_layer = layer(kept, False, 1e-5, plan_domain=pd, capacity_factor=None)
        ref = run(ref_layer, idx)
        solved = solve(plan.omega, topo, num_slots=2, policy=kept, plan_domain=pd,
                       expert_bytes=ref_layer.expert_bytes, token_bytes=plan.token_bytes)
        out[pd] = dict(fired=s["guard_fired"], local=s["plan_local"], names=guarded._plus_policies(),
                       slots=plan.slot_expert.tolist(),
                       domains=plan.topology.ranks_per_domain, plan_domain=plan.info.get("plan_domain"),
                       same_plan=torch.equal(plan.slot_expert, solved.slot_expert)
                       and torch.equal(plan.route, solved.route),
                       bit_equal=all(torch.equal(a, b) for a, b in zip(res, ref)))
    return out


def test_plan_domain_plans_a_large_domain_as_groups():
    results = run_ranks(_plan_domain_layers, 4)
    for r in results:
        grouped, whole = r[2], r[None]
        assert grouped["names"] == ("topoep_plus", "topoep_plus_local") and whole["names"] == ("topoep_plus",)
        for c in (grouped, whole):
            assert c["fired"] == 0.0 and c["same_plan"] and c["bit_equal"], c
            assert c["domains"] == 4  # the executed plan is on the real domain (the guard priced its real links)
        assert grouped["plan_domain"] == 2 and whole["plan_domain"] is None and whole["local"] == 0.0
        assert grouped["slots"] != whole["slots"]  # the groups plan differently here (stage 1 between the groups)
    assert len({(r[2]["local"], r[None]["local"]) for r in results}) == 1  # every rank decided alike
