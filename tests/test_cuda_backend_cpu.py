"""Backend cuda's logic on the CPU (the internal gloo harness, ExpertParallelMoE(_cpu_harness=True)): 4 processes over gloo as 2 domains of 2 (and, for every
policy once, 8 processes as 2 domains of 4: issue 10's EP-8 layout), the a2a workspace
and replica pool on a gloo exchange, torch references in place of the Triton kernels. Everything else is the GPU
path's code: the metadata (counts, plan, guard, statistics, receive layout), the autograd function with its
top-k weighting, the slot GEMMs, the replica fetch, the backward reload (and when it is left out) and the
gradient return. Checked against backend torch and an fp64 reference as the GPU tests do
(tests/test_cuda_backend_gpu.py): every policy's output and gradients (x, top-k weights, expert weights) within
2x backend torch's bf16 error; two layers sharing the slots (the earlier one reloads, the later one does not);
four layers with the backward prefetch (prefetch=True: two banks, no reload left).
Each with the tokens in one chunk and in two (num_chunks=2: a route split at the boundary, two regions
of the receive buffers)."""

import pytest
import torch

from distributed import run_ranks
from test_cuda_backend_gpu import E_LOC, FD, H, _dense, _guarded_plus, _routing

WORLD = 4  # as 2 domains of 2; one test runs 8 processes as 2 domains of 4 (issue 10's layout, on the CPU)


def _topology(world):
    from topoep import Topology

    return Topology(num_domains=2, ranks_per_domain=world // 2)


def harness(backend: str, chunks: int | None = None) -> dict:
    """ExpertParallelMoE keywords of backend cuda's CPU harness (gloo, torch references for the kernels) with its
    token chunks, or of backend torch with its default chunks."""
    return dict(_cpu_harness=True, num_chunks=chunks) if backend == "cuda" else {}


def _layer(E, policy, backend, fc1, fc2, lo, hi, chunks=1, prefetch=False, fetch_overlap=False):
    from topoep import ExpertParallelMoE

    layer = ExpertParallelMoE(num_experts=E, hidden_size=H, ffn_hidden_size=FD, topology=_topology(E // E_LOC), num_slots=2,
                              policy=policy, backend=backend, dtype=torch.bfloat16, device="cpu", guard=False,
                              prefetch=prefetch, **harness(backend, chunks),
                              **({"fetch_overlap": True} if fetch_overlap else {}))
    with torch.no_grad():
        layer.fc1.copy_(fc1[lo:hi])
        layer.fc2.copy_(fc2[lo:hi])
    return layer


def _errors(got, ref, lo, hi):
    """Max abs error of (x grad, w grad, fc1 grad, fc2 grad[, y]) against the fp64 reference."""
    return [float((a.double() - (b if i < 2 else b[lo:hi])).abs().max()) for i, (a, b) in enumerate(zip(got, ref))]


def problem(rank, world):
    """One rank's share of the layer problem the policy tests run: (E, lo, hi, fc1, fc2, this rank's fp64 reference
    (y, grad x, grad w, grad fc1, grad fc2 of all experts), its (x, topk_idx, weights, grad_y))."""
    E = world * E_LOC
    lo, hi = rank * E_LOC, (rank + 1) * E_LOC
    g = torch.Generator().manual_seed(3)
    fc1, fc2 = torch.randn(E, 2 * FD, H, generator=g) * 0.05, torch.randn(E, H, FD, generator=g) * 0.05
    data = _routing(world, 11, 3.0, "cpu")
    refs = [_dense(*d[:3], fc1, fc2, d[3]) for d in data]
    ref = [refs[rank][0], refs[rank][1], refs[rank][2], sum(r[3] for r in refs), sum(r[4] for r in refs)]
    return E, lo, hi, fc1, fc2, ref, data[rank]


def _policies(rank, world, policies, chunks):
    E, lo, hi, fc1, fc2, (y_ref, *ref), (x, idx, w, gy) = problem(rank, world)
    out = {}
    for policy in policies:
        for backend in ("torch", "cuda"):
            layer = _layer(E, policy, backend, fc1, fc2, lo, hi, chunks)
            ys = []
            for _ in range(2):
                layer.zero_grad(set_to_none=True)
                xr, wr = x.to(torch.bfloat16).requires_grad_(), w.to(torch.bfloat16).requires_grad_()
                y = layer(xr, idx, wr)
                (y * gy.to(torch.bfloat16)).sum().backward()
                ys.append(y.detach())
            errs = _errors([xr.grad, wr.grad, layer.fc1.grad, layer.fc2.grad], ref, lo, hi)
            errs.append(float((ys[-1].double() - y_ref).abs().max()))
            out[(policy, backend)] = (errs, layer.stats_dict()["replica_fraction"], torch.equal(ys[0], ys[1]))
    return out


@pytest.mark.parametrize("world, chunks", [(4, 1), (4, 2), pytest.param(8, 1, marks=pytest.mark.slow)])
def test_every_policy_matches_backend_torch_within_bf16_error(world, chunks):
    from topoep import POLICIES

    for out in run_ranks(_policies, world, list(POLICIES), chunks):
        for policy in POLICIES:
            errs_t, rep_t, _ = out[(policy, "torch")]
            errs_c, rep_c, repeatable = out[(policy, "cuda")]
            assert rep_c == rep_t and repeatable  # the same plan; two calls give the same output
            for what, ec, et in zip(("grad x", "grad w", "grad fc1", "grad fc2", "y"), errs_c, errs_t):
                assert ec <= 2 * et + 1e-6, f"{policy} {what}: error {ec:.3g} > 2 x torch's {et:.3g}"
        assert out[("topoep", "cuda")][1] > 0 and out[("deepseek", "cuda")][1] > 0  # replicas served tokens


def _layers(rank, world, chunks, n_layers, prefetch, fetch_overlap=False):
    """n_layers layers sharing the slots, each with its own weights and routing (so other replicas), forward in
    order, then backward in reverse (as autograd runs a model's layers); backend torch, then backend cuda
    (with prefetch off and, when `prefetch`, on; when `fetch_overlap`, also with LayerConfig.fetch_overlap, whose
    fetch runs in place on the harness: its pool has no side stream). Per run: the errors, the replica fractions,
    the pool's (fills, reloads left out, prefetches) and the gradients themselves."""
    E = world * E_LOC
    lo, hi = rank * E_LOC, (rank + 1) * E_LOC
    weights, data, refs = [], [], []
    for seed in range(7, 7 + n_layers):
        g = torch.Generator().manual_seed(seed)
        fc1, fc2 = torch.randn(E, 2 * FD, H, generator=g) * 0.05, torch.randn(E, H, FD, generator=g) * 0.05
        d = _routing(world, 30 + seed, 3.0, "cpu")
        r = [_dense(*q[:3], fc1, fc2, q[3]) for q in d]
        weights.append((fc1, fc2))
        data.append(d[rank])
        refs.append([r[rank][1], r[rank][2], sum(q[3] for q in r), sum(q[4] for q in r)])
    out = {}
    for run in ("torch", "cuda") + (("cuda+prefetch",) if prefetch else ()) + (("cuda+overlap",) if fetch_overlap
                                                                              else ()):
        backend = run.split("+")[0]
        layers = [_layer(E, "topoep", backend, fc1, fc2, lo, hi, chunks, prefetch=run == "cuda+prefetch",
                         fetch_overlap=run == "cuda+overlap") for fc1, fc2 in weights]
        losses, leaves = [], []
        for layer, (x, idx, w, gy) in zip(layers, data):
            xr, wr = x.to(torch.bfloat16).requires_grad_(), w.to(torch.bfloat16).requires_grad_()
            losses.append((layer(xr, idx, wr) * gy.to(torch.bfloat16)).sum())
            leaves.append((xr, wr))
        for loss in reversed(losses):
            loss.backward()
        errs, grads = [], []
        for layer, (xr, wr), ref in zip(layers, leaves, refs):
            got = [xr.grad, wr.grad, layer.fc1.grad, layer.fc2.grad]
            errs += _errors(got, ref, lo, hi)
            grads += got
        pool = layers[0].pool
        out[run] = (errs, [layer.stats_dict()["replica_fraction"] for layer in layers],
                    (pool.fills, pool.reloads_skipped, pool.prefetches, pool.banks) if backend == "cuda" else None,
                    grads)
    return out


def _check_errors(errs_c, errs_t, n_layers):
    names = [f"layer {i} grad {what}" for i in range(n_layers) for what in ("x", "w", "fc1", "fc2")]
    for what, ec, et in zip(names, errs_c, errs_t):
        assert ec <= 2 * et + 1e-6, f"{what}: error {ec:.3g} > 2 x torch's {et:.3g}"


@pytest.mark.parametrize("chunks", [1, 2])
def test_two_layers_share_the_slots_and_the_earlier_one_reloads(chunks):
    for out in run_ranks(_layers, WORLD, chunks, 2, False, True):
        (errs_t, reps_t, _, _), (errs_c, reps_c, counts, grads) = out["torch"], out["cuda"]
        assert reps_c == reps_t and all(r > 0 for r in reps_c), (reps_c, reps_t)
        assert counts == (3, 1, 0, 1), counts  # fetches: A, B, A's reload; B's reload left out
        _check_errors(errs_c, errs_t, 2)
        # fetch_overlap (on the same shared pool, whose counters go on): the same fetches, the same gradients bit
        # for bit
        _, reps_o, counts_o, grads_o = out["cuda+overlap"]
        assert reps_o == reps_c and tuple(b - a for a, b in zip(counts[:3], counts_o[:3])) == counts[:3]
        assert all(torch.equal(a, b) for a, b in zip(grads, grads_o))


def test_prefetch_refills_a_released_bank_for_a_later_backward():
    """Four layers A-D with prefetch=True (two banks): forward fills A, B, C, D alternate between the banks; D's
    and C's backward find their replicas in place; the end of D's backward refills its bank with B's replicas and
    the end of C's with A's, so no backward reloads. The gradients are bit for bit those of one bank (which
    reloads A, B and C)."""
    for out in run_ranks(_layers, WORLD, 1, 4, True):
        (errs_t, reps_t, _, _), (_, reps_1, counts_1, grads_1) = out["torch"], out["cuda"]
        errs_2, reps_2, counts_2, grads_2 = out["cuda+prefetch"]
        assert reps_1 == reps_2 == reps_t and all(r > 0 for r in reps_t), (reps_1, reps_2, reps_t)
        assert counts_1 == (7, 1, 0, 1), counts_1  # 4 forward fills, 3 reloads; D's reload left out
        assert counts_2 == (6, 4, 2, 2), counts_2  # 4 forward fills, 2 prefetches; every reload left out
        for i, (a, b) in enumerate(zip(grads_1, grads_2)):
            assert torch.equal(a, b), f"layer {i // 4} gradient {i % 4}: two banks differ from one"
        _check_errors(errs_2, errs_t, 4)


def _uneven(rank, world):
    """Ranks with different token counts (1, 8, 5, 8; max_tokens 8) in two chunks: every rank must make the same
    collectives (a rank with one token still runs both chunks) and the results match backend torch."""
    from topoep import ExpertParallelMoE

    E = world * E_LOC
    lo, hi = rank * E_LOC, (rank + 1) * E_LOC
    g = torch.Generator().manual_seed(4)
    fc1, fc2 = torch.randn(E, 2 * FD, H, generator=g) * 0.05, torch.randn(E, H, FD, generator=g) * 0.05
    x, idx, w, gy = (t[:(1, 8, 5, 8)[rank]] for t in _routing(world, 12, 3.0, "cpu")[rank])
    out = {}
    for backend in ("torch", "cuda"):
        layer = ExpertParallelMoE(num_experts=E, hidden_size=H, ffn_hidden_size=FD,
                                  topology=_topology(world), num_slots=2,
                                  policy="topoep", backend=backend, dtype=torch.bfloat16, device="cpu", guard=False,
                                  max_tokens=8 if backend == "cuda" else None, **harness(backend, 2))
        with torch.no_grad():
            layer.fc1.copy_(fc1[lo:hi])
            layer.fc2.copy_(fc2[lo:hi])
        xr, wr = x.to(torch.bfloat16).requires_grad_(), w.to(torch.bfloat16).requires_grad_()
        y = layer(xr, idx, wr)
        (y * gy.to(torch.bfloat16)).sum().backward()
        out[backend] = [t.float() for t in (y.detach(), xr.grad, wr.grad, layer.fc1.grad, layer.fc2.grad)]
    return [float((a - b).abs().max()) / (float(b.abs().max()) + 1e-6) for a, b in zip(out["cuda"], out["torch"])]


def test_two_chunks_with_uneven_token_counts():
    for rel in run_ranks(_uneven, WORLD):
        assert max(rel) < 0.05, rel  # bf16: the two backends round differently


@pytest.mark.parametrize("spread,peers,probe", [(True, False, False), (False, True, False), (True, True, True)],
                         ids=["plus_spread", "plus_peers", "probe"])
def test_one_rank_plans_nothing_and_runs_no_gated_planner(spread, peers, probe):
    """EP 1 (what tests/test_cuda_backend_gpu.py's guarded topoep_plus tests run at TOPOEP_GPU_WORLD=1): no replica
    can help one rank, so the pre-plan bound plans nothing on every call, the spread gate's probes included, and the
    guard fires; both backends log the same."""
    out = run_ranks(_guarded_plus, 1, spread, probe, peers, True)[0]
    assert out["cuda"] == out["torch"], out
    assert len(out["cuda"]) == (5 if probe else 3), out
    for fired, local, spread_kept, spread_planned, replicas, _, peer in out["cuda"]:
        assert (fired, local, spread_kept, spread_planned, replicas, peer) == (1.0, 0.0, 0.0, 0.0, 0.0, 0.0), out


def test_guarded_topoep_plus_plans_groups_alike_on_both_backends():
    """LayerConfig.plan_domain=2 on one domain of 4 (backend cuda's CPU harness): both backends plan topoep_plus and
    its local plan on the groups and keep the same plan on every call; the layer plans and keeps a balancing plan."""
    for out in run_ranks(_guarded_plus, 4, False, False, False, True, 2):
        assert out["cuda"] == out["torch"], out
        assert len(set(out["cuda"])) == 1 and out["cuda"][0][0] == 0.0 and out["cuda"][0][4] > 0.0, out
