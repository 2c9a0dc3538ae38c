"""GPU tests of backend `cuda` (2 GPUs, NCCL, or 2 ranks sharing fewer GPUs with TOPOEP_GPU_SHARE=1; skipped
otherwise; run them on the GPU machine):

- payloads: rows carrying (source, token, choice) arrive in the group-major layout at the instance the
  plan gives, and come back to their assignment;
- the layer against backend `torch` and an fp64 dense reference, for every policy, with skew: the cuda
  backend's error is within 2x the torch backend's bf16 error (STYLE.md 3), outputs and all gradients; three
  calls each (eager, metadata-graph capture, replay; policies without a GPU planner stay eager) give the
  same output; the receive regions are capacity-sized (the default capacity_factor), and without slots the hot
  rank's rows beyond its region go through the spill kernels;
- forward and backward under torch.cuda.set_sync_debug_mode("error") (no host synchronisation);
- the forward captured in a CUDA graph and replayed with new routing;
- two layers sharing the replica slots: the earlier one reloads its replicas in backward, the later one
  (whose replicas are still there) does not.

TOPOEP_GPU_CHUNKS=2 runs backend cuda's layers with two token chunks, TOPOEP_GPU_PREFETCH=1 with a second bank of
replica slots, TOPOEP_GPU_RELAY=f with replica fetches and gradient returns down / up relay trees of fanout f, and
TOPOEP_GPU_RELAY_CHUNKS=c with each relayed copy in c chunks (LayerConfig.num_chunks, .prefetch, .relay_fanout,
.relay_chunks), TOPOEP_GPU_RELAY_SCHEDULE=async with the relayed copies moved copy by copy (.relay_schedule), and
TOPOEP_GPU_FETCH_OVERLAP=1 with the forward fetch beside the dispatch (.fetch_overlap). The EP size is TOPOEP_GPU_WORLD (default 2; 1 runs every path but the copies between GPUs on one GPU) and the
(virtual) domain size TOPOEP_GPU_RPD (default: all ranks in one domain), e.g. TOPOEP_GPU_WORLD=8 TOPOEP_GPU_RPD=4 for EP 8 as 2 domains of 4, or TOPOEP_GPU_RPD=1 on 2
GPUs for 2 domains of 1: the plans then cross domains, while the data still moves through peer pointers (one
host). TOPOEP_GPU_TRANSPORT=a2a runs backend cuda's NVSHMEM transport (the path across hosts) instead of
peer pointers. TOPOEP_GPU_SHARE=1 lets the ranks share fewer GPUs (round-robin, gloo process group: distributed.py's
gpus_shared), e.g. EP 2 with its replicas on a one-GPU machine: every path's correctness, none of its speed.
"""

import os

import pytest
import torch

from distributed import gpus_for, gpus_shared, rank_device, run_ranks
from topoep.config import DEFAULT_CAPACITY_FACTOR

WORLD = int(os.environ.get("TOPOEP_GPU_WORLD", "2"))
RPD = int(os.environ.get("TOPOEP_GPU_RPD", str(WORLD)))
# a2a: NVSHMEM all-to-alls (a2a.py); deepep: DeepEP's dispatch and combine (deepep.py; needs deep_ep installed)
TRANSPORT = os.environ.get("TOPOEP_GPU_TRANSPORT", "peer")
# the layers' capacity_factor: a2a has no spill path and DeepEP sizes its own buffers: both keep the worst case
CF = None if TRANSPORT in ("a2a", "deepep") else DEFAULT_CAPACITY_FACTOR
# tests of the peer / a2a workspaces' own payload layout, or of whole-layer capture, which transport deepep has not
not_deepep = pytest.mark.skipif(TRANSPORT == "deepep", reason="the peer and a2a workspaces' layout or whole-layer "
                                "capture: transport deepep has neither")
CHUNKS = int(os.environ.get("TOPOEP_GPU_CHUNKS", "1"))  # backend cuda's token chunks (LayerConfig.num_chunks)
PREFETCH = os.environ.get("TOPOEP_GPU_PREFETCH", "0") == "1"  # a second bank of replica slots (LayerConfig.prefetch)
RELAY = int(os.environ.get("TOPOEP_GPU_RELAY", "0")) or None  # replica fetches down relay trees (LayerConfig.relay_fanout)
# transport deepep: DeepEP's deterministic receive order (LayerConfig.deepep_deterministic); 0 leaves it off, where the
# bitwise comparisons of weight gradients between layers do not hold
DEEPEP_DETERMINISTIC = os.environ.get("TOPOEP_GPU_DEEPEP_DETERMINISTIC", "1") == "1"
RELAY_CHUNKS = int(os.environ.get("TOPOEP_GPU_RELAY_CHUNKS", "1"))  # chunks per relayed copy (LayerConfig.relay_chunks)
# how relayed fetches run: levels, or copy by copy (LayerConfig.relay_schedule "async"; transport peer)
RELAY_SCHEDULE = os.environ.get("TOPOEP_GPU_RELAY_SCHEDULE", "levels")
# the forward fetch beside the dispatch (LayerConfig.fetch_overlap; transport peer)
FETCH_OVERLAP = os.environ.get("TOPOEP_GPU_FETCH_OVERLAP", "0") == "1"
if WORLD < 1 or RPD < 1 or WORLD % RPD:
    raise ValueError(f"TOPOEP_GPU_WORLD={WORLD} / TOPOEP_GPU_RPD={RPD}: need a world of at least 1 rank and a "
                     "domain size that divides it")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gpus_for(WORLD), reason=f"needs {WORLD} GPUs (TOPOEP_GPU_WORLD; or "
                                 "TOPOEP_GPU_SHARE=1 to let the ranks share fewer)"),
              # NVSHMEM with two processes on one GPU hung here (results/gpu/shared_ep2_b98cd92/README.md)
              pytest.mark.skipif(TRANSPORT == "a2a" and gpus_shared(WORLD),
                                 reason="transport a2a needs a GPU per rank: it hung with TOPOEP_GPU_SHARE=1")]


def cuda_options(**changes) -> dict:
    """The LayerConfig fields of this run's backend cuda layers (the variant the TOPOEP_GPU_* variables choose). With
    transport deepep: DeepEP's deterministic receive order unless TOPOEP_GPU_DEEPEP_DETERMINISTIC=0 (the bitwise
    comparisons need it; the sync test always turns it off: DeepEP's sort synchronises the host)."""
    deepep = {"deepep_deterministic": DEEPEP_DETERMINISTIC} if TRANSPORT == "deepep" else {}
    return {"transport": TRANSPORT, "capacity_factor": CF, "num_chunks": CHUNKS, "prefetch": PREFETCH,
            "relay_fanout": RELAY, "relay_chunks": RELAY_CHUNKS if RELAY else 1, "fetch_overlap": FETCH_OVERLAP,
            "relay_schedule": RELAY_SCHEDULE if RELAY else "levels",
            **deepep, **changes}


def _topology():
    from topoep import Topology

    return Topology(num_domains=WORLD // RPD, ranks_per_domain=RPD)

E_LOC, T, K, H, FD = 8, 96, 4, 256, 128


def _setup(rank):
    dev = rank_device(rank)
    torch.cuda.set_device(dev)
    return dev


def _routing(world, seed, skew, dev):
    """Every rank's (x, topk_idx, weights, grad_y): hot experts on rank 0 (the concentrated layout)."""
    E = world * E_LOC
    g = torch.Generator().manual_seed(seed)
    bias = torch.zeros(E)
    bias[:E_LOC] = skew
    out = []
    for s in range(world):
        logits = torch.randn(T, E, generator=g) + bias
        idx = torch.topk(logits, K, dim=1).indices
        w = torch.softmax(torch.gather(logits, 1, idx), 1)
        x = torch.randn(T, H, generator=g)
        gy = torch.randn(T, H, generator=g)
        out.append((x, idx, w, gy))
    return out


def _payload(rank, world, policy):
    import torch.distributed as dist

    from topoep import solve
    from topoep.runtime.backend import CudaBackend
    from topoep.runtime.layout import (assignment_instances, count_keys, local_group, receive_positions,
                                       received_sizes)

    dev = _setup(rank)
    E, N = world * E_LOC, 2
    G = E_LOC + N
    be = CudaBackend(transport=TRANSPORT)
    ws = be.workspace(T, K, E, N, H, torch.bfloat16, dev)
    results = []
    for seed in range(3):
        _, idx, _, _ = _routing(world, seed, 3.0, dev)[rank]
        idx = idx.to(dev)
        omega = ws.all_gather(count_keys(idx, E), 0)
        plan = solve(omega, _topology(), num_slots=N, policy=policy,
                     expert_bytes=1000, token_bytes=10)
        inst = assignment_instances(idx, plan, rank)
        key, order = torch.sort(plan.instance_rank[inst] * G + local_group(inst, plan), stable=True)
        C = ws.all_gather(count_keys(key, world * G), 1).view(world, world, G)
        dest, pos, is_slot = receive_positions(C, key, rank, E_LOC)
        sm, ss = received_sizes(C, rank, E_LOC)
        a = torch.arange(T * K, device=dev)
        # payload per assignment row: (source, token % 256, token // 256, choice, expert), exact in bf16
        rows = torch.zeros(T * K, H, device=dev)
        rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3] = rank, (a // K) % 256, (a // K) // 256, a % K
        rows[:, 4] = idx.reshape(-1).float() % 256
        rows = rows.to(torch.bfloat16)
        rm, rs = ws.dispatch(rows, order, 1, dest, pos, is_slot)
        got_main, got_slot = rm[: int(sm.sum())].float().cpu(), rs[: int(ss.sum())].float().cpu()
        back = ws.combine(rm, rs, sm.sum().view(1), ss.sum().view(1), T * K)
        # expected: every rank's assignments routed here, group-major, sources in rank order
        all_rows = [torch.empty_like(rows) for _ in range(world)]
        all_keys = [torch.empty_like(key) for _ in range(world)]
        all_order = [torch.empty_like(order) for _ in range(world)]
        dist.all_gather(all_rows, rows)
        dist.all_gather(all_keys, key)
        dist.all_gather(all_order, order)
        exp = {False: [], True: []}
        for grp in range(G):
            for s in range(world):
                sel = all_keys[s] == rank * G + grp
                exp[grp >= E_LOC].append(all_rows[s][all_order[s][sel]].float().cpu())
        ok_main = torch.equal(got_main, torch.cat(exp[False]))
        ok_slot = torch.equal(got_slot, torch.cat(exp[True]))
        results.append((ok_main, ok_slot, torch.equal(back, rows), int(ss.sum()), int(ws.overflow.item())))
    return results


@not_deepep
@pytest.mark.parametrize("policy", ["static", "topoep"])
def test_payloads_arrive_in_the_group_major_layout_and_return(policy):
    results = run_ranks(_payload, WORLD, policy, backend="nccl")
    for per_rank in results:
        for ok_main, ok_slot, round_trip, slot_rows, overflow in per_rank:
            assert ok_main and ok_slot and round_trip and overflow == 0
    slot_rows = sum(r[3] for per_rank in results for r in per_rank)
    if WORLD > 1:  # replicas served rows only under topoep (one rank has no replica to serve)
        assert slot_rows > 0 if policy == "topoep" else slot_rows == 0


def _dense(x, idx, w, fc1, fc2, gy):
    """fp64 reference of one rank's layer: y and the gradients of x, w, fc1, fc2 (all experts)."""
    x, w, fc1, fc2 = (t.double().requires_grad_() for t in (x, w, fc1, fc2))
    h = torch.einsum("th,tkfh->tkf", x, fc1[idx])
    Fd = h.shape[-1] // 2
    act = torch.nn.functional.silu(h[..., :Fd]) * h[..., Fd:]
    y = (torch.einsum("tkf,tkhf->tkh", act, fc2[idx]) * w[..., None]).sum(1)
    (y * gy.double()).sum().backward()
    return [t.detach() for t in (y, x.grad, w.grad, fc1.grad, fc2.grad)]


def _layer_errors(rank, world, policies, num_slots):
    """For each policy and backend: the max abs error of (y, grad x, grad w, grad fc1, grad fc2) against
    the fp64 reference (the gradients of all ranks' tokens summed for the expert weights)."""
    import torch.distributed as dist

    from topoep import ExpertParallelMoE

    dev = _setup(rank)
    E = world * E_LOC
    g = torch.Generator().manual_seed(3)
    fc1 = torch.randn(E, 2 * FD, H, generator=g) * 0.05
    fc2 = torch.randn(E, H, FD, generator=g) * 0.05
    data = _routing(world, 11, 3.0, dev)
    refs = [_dense(x, idx, w, fc1, fc2, gy) for x, idx, w, gy in data]
    ref = refs[rank][:3] + [sum(r[3] for r in refs), sum(r[4] for r in refs)]
    lo, hi = rank * E_LOC, (rank + 1) * E_LOC
    x, idx, w, gy = (t.to(dev) for t in data[rank])
    topo = _topology()
    out = {}
    for policy in policies:
        for backend in ("torch", "cuda", "cuda-lists"):
            # cuda-lists: separate per-expert parameters (megatron's layout), stacked by the layer
            lists = None
            if backend == "cuda-lists":
                lists = ([torch.nn.Parameter(w.to(dev, torch.bfloat16)) for w in fc1[lo:hi]],
                         [torch.nn.Parameter(w.to(dev, torch.bfloat16)) for w in fc2[lo:hi]])
            layer = ExpertParallelMoE(num_experts=E, hidden_size=H, ffn_hidden_size=FD, topology=topo,
                                      num_slots=num_slots, policy=policy, backend=backend.split("-")[0],
                                      dtype=torch.bfloat16, device=dev, guard=False,
                                      **(cuda_options() if backend != "torch" else dict(capacity_factor=CF,
                                                                                        relay_fanout=RELAY)),
                                      expert_weights=(lambda lists=lists: lists) if lists else None)
            if lists is None:
                with torch.no_grad():
                    layer.fc1.copy_(fc1[lo:hi])
                    layer.fc2.copy_(fc2[lo:hi])
            ys = []
            for _ in range(3):  # call 1 eager, call 2 captures the metadata graph, call 3 replays it
                layer.zero_grad(set_to_none=True)
                for p in (lists[0] + lists[1]) if lists else ():
                    p.grad = None
                xr = x.to(torch.bfloat16).requires_grad_()
                wr = w.to(torch.bfloat16).requires_grad_()
                y = layer(xr, idx, wr)
                (y * gy.to(torch.bfloat16)).sum().backward()
                ys.append(y.detach())
            assert all(torch.equal(ys[0], yi) for yi in ys[1:]), f"{policy}/{backend}: calls 2-3 differ from call 1"
            g1, g2 = ((torch.stack([p.grad for p in lists[0]]), torch.stack([p.grad for p in lists[1]])) if lists
                      else (layer.fc1.grad, layer.fc2.grad))
            got = [y.detach(), xr.grad, wr.grad, g1, g2]
            errs = [float((a.double().cpu() - b[lo:hi] if i >= 3 else a.double().cpu() - b).abs().max())
                    for i, (a, b) in enumerate(zip(got, ref))]
            s = layer.stats_dict()
            spilled = 0
            if backend != "torch":
                assert int(layer.workspace.overflow.item()) == 0
                spilled = int(layer.workspace.spilled_rows.item())
            out[(policy, backend)] = (errs, s["replica_fraction"], s["capacity_overflow"], spilled)
    dist.barrier()
    return out


@pytest.mark.parametrize("num_slots", [2, 0])
def test_layer_matches_torch_backend_within_bf16_error(num_slots):
    from topoep import POLICIES

    policies = list(POLICIES) if num_slots else ["static", "topoep"]
    spilled = 0
    for out in run_ranks(_layer_errors, WORLD, policies, num_slots, backend="nccl"):
        for policy in policies:
            errs_t, rep_t, over_t, _ = out[(policy, "torch")]
            for backend in ("cuda", "cuda-lists"):
                errs_c, rep_c, over_c, rows = out[(policy, backend)]
                assert rep_c == rep_t and over_c == over_t  # the same plan, capacity step included
                spilled += rows
                names = ("y", "grad x", "grad w", "grad fc1", "grad fc2")
                for name, ec, et in zip(names, errs_c, errs_t):
                    assert ec <= 2 * et + 1e-6, f"{policy} {backend} {name}: error {ec:.3g} > 2 x torch's {et:.3g}"
        if num_slots and WORLD > 1:  # replicas exercised (across 2 domains of 1 rank, topoep finds them not worth it)
            assert any(out[(p, "cuda")][1] > 0 for p in policies)
            if RPD > 1:
                assert out[("topoep", "cuda")][1] > 0
    if not num_slots and WORLD > 1 and CF is not None:  # no slot for the capacity step: the hot rank's rows beyond its region spilled
        assert spilled > 0


@pytest.mark.skipif(WORLD < 4 or RPD < 2, reason="a relay tree deeper than one level needs 2 domains of 2+ ranks")
def test_relayed_replicas_match_the_direct_path():
    """Replica fetches and gradient returns down / up relay trees (LayerConfig.relay_fanout) on this run's transport,
    against the direct path (tests/test_relay_runtime.py's check_relays, as on the CPU harness)."""
    from test_relay_runtime import check_relays, relay_cuda

    check_relays(run_ranks(relay_cuda, WORLD, RPD, CHUNKS, PREFETCH, cuda_options(), backend="nccl"), PREFETCH,
                 WORLD // RPD)


SIDE_FETCHES = {"prefetch": 0, "fetch": 0}  # fetches the slowed pools ran on each side stream (this process)
# GPU cycles each slowed fetch spins first: ~10 ms on the prefetch stream; ~0.5 s on the forward's fetch stream, whose
# slot GEMMs come after only the dispatch and the main GEMMs (with 8 ranks time-slicing one GPU, tens of ms)
SIDE_SLEEP = {"prefetch": 20_000_000, "fetch": 1_000_000_000}


def _slow_side_fetches(cuda_function):
    """Every pool's fetch, when it runs on the prefetch stream or the forward's "fetch" stream (fetch_overlap),
    first spins the GPU (SIDE_SLEEP) and is counted (SIDE_FETCHES)."""
    from topoep.runtime.a2a import A2AReplicaPool
    from topoep.runtime.symm import SymmReplicaPool

    for cls in (SymmReplicaPool, A2AReplicaPool):
        if getattr(cls.fetch, "slowed", False):
            continue
        orig = cls.fetch

        def fetch(self, *args, _orig=orig, **kw):
            dev = torch.cuda.current_device()
            for role in SIDE_FETCHES:
                if torch.cuda.current_stream(dev) == cuda_function.side_stream(dev, role):
                    SIDE_FETCHES[role] += 1
                    torch.cuda._sleep(SIDE_SLEEP[role])
            return _orig(self, *args, **kw)

        fetch.slowed = True
        cls.fetch = fetch


def _two_layers(rank, world, n_layers=4):
    """Layers A-D share the replica slots: forward in order, then backward in reverse. With one bank, D's
    backward finds its replicas still in the slots and leaves the reload out; the others must reload. With
    prefetch=True (two banks, run "cuda-prefetch") D and C find theirs, and the ends of D's and C's backward
    refill their banks, on the prefetch stream (made ~10 ms late on purpose), with B's and A's replicas: no reload.
    With fetch_overlap=True (run "cuda-fetch-overlap") every forward fetch and backward reload runs on the fetch
    stream, made ~0.5 s late: slot GEMMs that did not wait for it would read another layer's replicas. All against backend torch and
    the fp64 reference, as in _layer_errors, and bit for bit against run "cuda"."""
    from topoep import ExpertParallelMoE

    dev = _setup(rank)
    E = world * E_LOC
    lo, hi = rank * E_LOC, (rank + 1) * E_LOC
    policy = "topoep" if RPD > 1 else "flexmoe"  # across domains of 1 rank topoep and deepseek place no replica
    weights, data, refs = [], [], []
    for seed in range(7, 7 + n_layers):  # other weights, other routing, so other replicas
        g = torch.Generator().manual_seed(seed)
        fc1, fc2 = torch.randn(E, 2 * FD, H, generator=g) * 0.05, torch.randn(E, H, FD, generator=g) * 0.05
        d = _routing(world, 30 + seed, 3.0, dev)
        r = [_dense(x, idx, w, fc1, fc2, gy) for x, idx, w, gy in d]
        weights.append((fc1, fc2))
        data.append(tuple(t.to(dev) for t in d[rank]))
        refs.append(r[rank][:3] + [sum(q[3] for q in r), sum(q[4] for q in r)])
    out = {}
    from topoep.runtime import cuda_function

    # the last three: combine_side_stream's path, prefetch's, fetch_overlap's (the gradient return's on-stream path
    # runs with transport a2a, whose pool has no push_grads, and on the CPU harness); fetch_overlap: peer only
    names = ("torch", "cuda", "cuda-combine-side", "cuda-prefetch") + (("cuda-fetch-overlap",) if TRANSPORT == "peer"
                                                                       else ())
    for name in names:
        backend = name.split("-")[0]
        if name == "cuda-prefetch":  # the side streams start late: a dispatch that did not wait would read old slots
            _slow_side_fetches(cuda_function)
        layers = []
        for fc1, fc2 in weights:
            layer = ExpertParallelMoE(num_experts=E, hidden_size=H, ffn_hidden_size=FD, topology=_topology(),
                                      num_slots=2, policy=policy, backend=backend, dtype=torch.bfloat16, device=dev,
                                      guard=False, **(cuda_options(combine_side_stream=name == "cuda-combine-side",
                                                                   prefetch=name == "cuda-prefetch",
                                                                   fetch_overlap=FETCH_OVERLAP
                                                                   or name == "cuda-fetch-overlap")
                                                      if backend == "cuda" else dict(capacity_factor=CF)))
            with torch.no_grad():
                layer.fc1.copy_(fc1[lo:hi])
                layer.fc2.copy_(fc2[lo:hi])
            layers.append(layer)
        losses, xs, ws = [], [], []
        for layer, (x, idx, w, gy) in zip(layers, data):
            xr = x.to(torch.bfloat16).requires_grad_()
            wr = w.to(torch.bfloat16).requires_grad_()
            losses.append((layer(xr, idx, wr) * gy.to(torch.bfloat16)).sum())
            xs.append(xr)
            ws.append(wr)
        for loss in reversed(losses):  # the order of a model's backward
            loss.backward()
        errs, grads = [], []
        for layer, xr, wr, ref in zip(layers, xs, ws, refs):
            got = [xr.grad, wr.grad, layer.fc1.grad, layer.fc2.grad]
            errs += [float((a.double().cpu() - (b if i < 2 else b[lo:hi])).abs().max())
                     for i, (a, b) in enumerate(zip(got, ref[1:]))]
            grads += got
        reps = [layer.stats_dict()["replica_fraction"] for layer in layers]
        pool = layers[0].pool if backend == "cuda" else None
        # the cuda runs share the process's pool: this run's own counts
        now = (pool.fills, pool.reloads_skipped, pool.prefetches) if pool is not None else None
        before = getattr(pool, "_counted", (0, 0, 0)) if pool is not None else None
        counts = tuple(a - b for a, b in zip(now, before)) if pool is not None else None
        if pool is not None:
            pool._counted = now
        side = dict(SIDE_FETCHES)
        for role in SIDE_FETCHES:
            SIDE_FETCHES[role] = 0
        out[name] = (errs, reps, counts, grads, side)
    return {k: v[:3] + ((v[3] is out["cuda"][3] or all(torch.equal(a, b) for a, b in zip(v[3], out["cuda"][3]))),
                        v[4]) for k, v in out.items()}


@pytest.mark.skipif(WORLD < 2, reason="a replica needs a second rank")
def test_layers_share_the_slots_and_reload_or_prefetch():
    for out in run_ranks(_two_layers, WORLD, backend="nccl"):
        errs_t, reps_t, _, _, _ = out["torch"]
        assert ("cuda-fetch-overlap" in out) == (TRANSPORT == "peer")
        if TRANSPORT == "peer":  # the slowed side streams ran the fetches: the prefetches; with fetch_overlap every
            # forward fill and backward reload (one bank: A's, B's and C's reloads)
            assert out["cuda-prefetch"][4] == {"prefetch": 2, "fetch": 4 if FETCH_OVERLAP else 0}
            assert out["cuda-fetch-overlap"][4] == {"prefetch": 0, "fetch": 7}
        for name in [n for n in out if n != "torch"]:
            errs_c, reps_c, counts, same_as_cuda, _ = out[name]
            assert reps_c == reps_t and all(r > 0 for r in reps_c), (reps_c, reps_t)  # every layer uses replicas
            # fetches: 4 forward fills, then one bank: 3 reloads (D's left out); two banks: 2 prefetches, no reload
            assert counts == ((6, 4, 2) if name == "cuda-prefetch" else (7, 1, 0)), (name, counts)
            names = [f"{layer} grad {what}" for layer in "ABCD" for what in ("x", "w", "fc1", "fc2")]
            for what, ec, et in zip(names, errs_c, errs_t):
                assert ec <= 2 * et + 1e-6, f"{name} {what}: error {ec:.3g} > 2 x torch's {et:.3g}"
            # the gradient return or the combine on the layer's stream or a side stream, replicas reloaded or
            # prefetched: the same sums in the same order
            assert same_as_cuda, f"{name}: gradients differ from the side-stream return's"


def _slot_skip(rank, world):
    """A topoep layer whose guard always fires (plan_s = 1 s) against the static layer, 4 calls: calls 3-4
    leave the replica machinery out (the hint, lag 2); every call equals the static layer bit for bit. A
    guard that never fires (no costs, skewed routing) never skips and uses its replicas. Without the capacity step
    (capacity_factor=None): at this skew it would place replicas in the static plan, and the hint keeps the replica
    machinery for them (tests/test_capacity_runtime.py)."""
    from topoep import ExpertParallelMoE
    from topoep.runtime import NetBenefitGuard

    dev = _setup(rank)
    E = world * E_LOC
    topo = _topology()
    g = torch.Generator().manual_seed(5)
    fc1 = (torch.randn(E_LOC, 2 * FD, H, generator=g) * 0.05).to(dev, torch.bfloat16)
    fc2 = (torch.randn(E_LOC, H, FD, generator=g) * 0.05).to(dev, torch.bfloat16)
    guards = {"static": None, "fires": NetBenefitGuard(plan_s=1.0),
              "never": NetBenefitGuard(plan_s=0.0, transfer_latency_s=0.0)}
    layers = {}
    for name, guard in guards.items():
        layers[name] = ExpertParallelMoE(num_experts=E, hidden_size=H, ffn_hidden_size=FD, topology=topo, num_slots=2,
                                         policy="static" if guard is None else "topoep", backend="cuda",
                                         dtype=torch.bfloat16, device=dev, guard=guard or False,
                                         **cuda_options(capacity_factor=None))
        with torch.no_grad():
            layers[name].fc1.copy_(fc1)
            layers[name].fc2.copy_(fc2)
    out = {name: [] for name in layers}
    replicas = []
    for call in range(4):
        x, idx, w, gy = (t.to(dev) for t in _routing(world, 20 + call, 3.0, dev)[rank])
        for name, layer in layers.items():
            layer.zero_grad(set_to_none=True)
            xr = x.to(torch.bfloat16).requires_grad_()
            y = layer(xr, idx, w.to(torch.bfloat16))
            (y * gy.to(torch.bfloat16)).sum().backward()
            out[name].append((y.detach(), xr.grad, layer.fc1.grad, layer.fc2.grad))
            if name == "never":
                replicas.append(layer.stats_dict()["replica_fraction"])
    same = [all(torch.equal(a, b) for a, b in zip(out["fires"][c], out["static"][c])) for c in range(4)]
    fired = layers["fires"].stats_dict()["guard_fired"]
    f, n = layers["fires"].stats_dict(), layers["never"].stats_dict()
    logged = (f["slot_skipped"], n["slot_skipped"], f["guard_wanted"], f["slot_skip_missed"])
    return same, fired, layers["fires"].slot_hint.skipped, layers["never"].slot_hint.skipped, replicas, logged


def test_guard_that_fires_skips_the_replica_machinery_and_equals_static():
    for same, fired, skipped, skipped_never, replicas, logged in run_ranks(_slot_skip, WORLD, backend="nccl"):
        assert all(same), same
        assert fired == 1.0 and skipped == 2  # calls 3 and 4 of lag 2
        assert logged[0] == 1.0  # the last call's statistics say it skipped (moe/slot_skip in the trainer)
        assert logged[2:] == (0.0, 0.0)  # and that its guard did not want replicas: nothing missed
        if RPD > 1:  # across domains of 1 rank topoep finds no replica worth it, and then wants none
            assert skipped_never == 0 and all(r > 0 for r in replicas) and logged[1] == 0.0, replicas


def _guarded_plus(rank, world, spread=False, probe=False, peers=False, cpu=False, plan_domain=32):
    """Guarded topoep_plus on backends torch and cuda, 3 calls (eager, graph capture, replay): the CUDA path plans
    topoep_plus and its local candidate (with `spread`, LayerConfig.plus_spread, also the spread candidates,
    csrc/spread.cu) at the same time (topoep.planners.plan_concurrently, in the metadata graph) and keeps the same
    candidate as backend torch's reference planners. The spread gate (guard.SpreadGate) asks nothing of a spread plan
    beyond beating the others (spread_plan_s 0), probing it on call 2 (spread_probe 2); with `probe`, 5 calls of a
    spread planner that never pays (spread_plan_s 1 s): it runs on the probes, calls 2 and 4, only, the gate's state
    carried through the graph's replays. With `peers` (LayerConfig.plus_peers) FlexMoE's and DeepSeek EPLB's plans
    (csrc/peers.cu) are candidates too. With `cpu`, on the CPU over gloo (backend cuda's CPU harness, one domain of
    `world` ranks: tests/test_cuda_backend_cpu.py). plan_domain: LayerConfig.plan_domain of both layers."""
    from topoep import ExpertParallelMoE, Topology
    from topoep.runtime import NetBenefitGuard

    dev = "cpu" if cpu else _setup(rank)
    E = world * E_LOC
    topo = Topology(num_domains=1, ranks_per_domain=world) if cpu else _topology()
    out = {}
    for backend in ("torch", "cuda"):
        guard = NetBenefitGuard(plan_s=0.0, transfer_latency_s=0.0, spread_plan_s=1.0 if probe else 0.0)
        layer = ExpertParallelMoE(num_experts=E, hidden_size=H, ffn_hidden_size=FD, topology=topo, num_slots=2,
                                  policy="topoep_plus", backend=backend, dtype=torch.bfloat16, device=dev,
                                  guard=guard, plus_spread=spread, plus_peers=peers, spread_probe=2,
                                  plan_domain=plan_domain,
                                  **(dict(capacity_factor=None, _cpu_harness=True) if cpu and backend == "cuda" else
                                     cuda_options(capacity_factor=None) if backend == "cuda" else
                                     dict(capacity_factor=None, relay_fanout=RELAY)))
        rows = []
        for call in range(5 if probe else 3):
            x, idx, w, gy = (t.to(dev) for t in _routing(world, 30, 3.0, dev)[rank])
            xr = x.to(torch.bfloat16).requires_grad_()
            y = layer(xr, idx, w.to(torch.bfloat16))
            (y * gy.to(torch.bfloat16)).sum().backward()
            s = layer.stats_dict()
            rows.append((s["guard_fired"], s["plan_local"], s["plan_spread"], s["spread_planned"],
                         s["replica_fraction"], s["imbalance"], s["plan_peer"]))
        out[backend] = rows
    return out


@pytest.mark.parametrize("spread,peers", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["plus", "plus_spread", "plus_peers", "plus_spread_peers"])
def test_guarded_topoep_plus_keeps_the_same_candidate_on_both_backends(spread, peers):
    for out in run_ranks(_guarded_plus, WORLD, spread, False, peers, backend="nccl"):
        assert out["cuda"] == out["torch"], out
        if WORLD == 1:  # one rank: nothing to balance, the pre-plan bound plans nothing (no gated planner, no probe)
            assert all(r[0] == 1.0 and r[3] == 0.0 for r in out["cuda"]), out
        elif spread or peers:  # the spread gate probes on call 2 and keeps the gated planners on where their plan is kept
            kept = max(out["cuda"][1][2], out["cuda"][1][6])
            assert [r[3] for r in out["cuda"]] == [0.0, 1.0, kept], out
            assert out["cuda"][2] == out["cuda"][1] or not kept, out
        else:
            assert len(set(out["cuda"])) == 1  # the same decision on every call (eager, captured, replayed)


@pytest.mark.skipif(RPD < 2, reason="needs a domain of 2 or more ranks to plan as groups")
def test_guarded_topoep_plus_plans_groups_alike_on_both_backends():
    """LayerConfig.plan_domain below the domain's size: both backends plan topoep_plus and its local plan on groups of
    half the domain (the CUDA planner on the groups' topology) and keep the same plan on every call."""
    for out in run_ranks(_guarded_plus, WORLD, False, False, False, False, RPD // 2, backend="nccl"):
        assert out["cuda"] == out["torch"], out
        assert len(set(out["cuda"])) == 1 and out["cuda"][0][0] == 0.0, out  # planned, the same on every call


def test_guarded_topoep_plus_spread_gate_probes():
    for out in run_ranks(_guarded_plus, WORLD, True, True, backend="nccl"):
        assert out["cuda"] == out["torch"], out
        # one rank: the pre-plan bound plans nothing, so no call probes
        probes = [0.0] * 5 if WORLD == 1 else [0.0, 1.0, 0.0, 1.0, 0.0]
        assert [r[3] for r in out["cuda"]] == probes, out


def _sync_free_and_graph(rank, world):
    from topoep import ExpertParallelMoE

    dev = _setup(rank)
    E = world * E_LOC
    topo = _topology()
    layer = ExpertParallelMoE(num_experts=E, hidden_size=H, ffn_hidden_size=FD, topology=topo, num_slots=2,
                              policy="topoep", backend="cuda", dtype=torch.bfloat16, device=dev,
                              **cuda_options(**({"deepep_deterministic": False} if TRANSPORT == "deepep" else {})))
    batches = [tuple(t.to(dev) for t in b[rank]) for b in (_routing(world, s, 3.0, dev) for s in range(3))]

    def step(x, idx, w, gy, backward=True):
        xr = x.to(torch.bfloat16).requires_grad_(backward)
        y = layer(xr, idx, w.to(torch.bfloat16))
        if backward:
            (y * gy.to(torch.bfloat16)).sum().backward()
        return y

    # warm-up: buffers, Triton compilation, the planner's workspace; each metadata variant's graph is captured on its
    # second call (capturing synchronises once). The slot hint (lag 2) may switch the variant on call 3: at EP 1 no
    # replica can exist, so calls 3 on plan nothing and use a graph of their own, captured on call 4.
    for _ in range(4):
        step(*batches[0])
    torch.cuda.synchronize()
    replays_before = layer._meta_graphs.replays
    torch.cuda.set_sync_debug_mode("error")
    try:
        y_graph = step(*batches[1]).detach()  # metadata replayed from the graph
        sync_free = True
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    replays = layer._meta_graphs.replays - replays_before
    layer._meta_graphs.enabled = False  # the same call with eager metadata: the same plan, bitwise the same y
    same_as_eager = torch.equal(step(*batches[1]).detach(), y_graph)
    layer._meta_graphs.enabled = True
    # graph capture of the forward (inference: no autograd graph), replayed with new routing
    layer.zero_grad(set_to_none=True)
    sx, sidx, sw = (batches[0][i].clone() for i in range(3))
    with torch.no_grad():
        step(sx, sidx, sw, None, backward=False)  # warm-up without grad
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step(sx, sidx, sw, None, backward=False)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gy_static = step(sx, sidx, sw, None, backward=False)
        results = []
        for b in batches:
            sx.copy_(b[0])
            sidx.copy_(b[1])
            sw.copy_(b[2])
            graph.replay()
            eager = step(*b[:3], None, backward=False)
            results.append(torch.equal(gy_static, eager))
    torch.cuda.synchronize()
    return sync_free, results, replays, same_as_eager


def test_no_host_sync_and_forward_graph_replay():
    for sync_free, same, replays, same_as_eager in run_ranks(_sync_free_and_graph, WORLD, backend="nccl"):
        assert sync_free
        assert all(same), same
        assert replays == 1 and same_as_eager  # the layer's own metadata graph: replayed, and equal to eager


def _graphed_layer(rank, world, owned):
    """A layer captured whole (forward and backward) against an identical eager layer, on three routings replayed one
    after another: outputs and every gradient bit for bit, no host sync in a replay, and the statistics of the
    replays averaged as the eager calls' are, and weight gradients accumulated over two calls as the eager layer's.
    owned: the layer's own stacked parameters, captured by
    topoep.graph_layer; else per-expert weights it reads through expert_weights (as under megatron), captured on its
    first call by LayerConfig.layer_graphs."""
    from topoep import ExpertParallelMoE, graph_layer
    from topoep.runtime import LAYER_STAT_NAMES, NetBenefitGuard

    dev = _setup(rank)
    E = world * E_LOC
    layers, weights = [], []  # no slot hint: the eager layer would leave some calls' replica machinery out
    for graphed in (False, True):
        torch.manual_seed(0)
        kw = {}
        if not owned:
            w1 = [torch.nn.Parameter(torch.randn(2 * FD, H, device=dev).to(torch.bfloat16) * H ** -0.5)
                  for _ in range(E_LOC)]
            w2 = [torch.nn.Parameter(torch.randn(H, FD, device=dev).to(torch.bfloat16) * FD ** -0.5)
                  for _ in range(E_LOC)]
            kw = dict(expert_weights=lambda w1=w1, w2=w2: (w1, w2), layer_graphs=graphed)
            weights.append(w1 + w2)
        layers.append(ExpertParallelMoE(num_experts=E, hidden_size=H, ffn_hidden_size=FD, topology=_topology(),
                                        num_slots=2, policy="topoep", backend="cuda", dtype=torch.bfloat16,
                                        device=dev, guard=NetBenefitGuard(skip_lag=None),
                                        **cuda_options(prefetch=False, **kw)))
        if owned:
            weights.append([layers[-1].fc1, layers[-1].fc2])
    eager, graphed = layers
    batches = [tuple(t.to(dev) for t in b[rank]) for b in (_routing(world, s, 3.0, dev) for s in range(3))]

    def inputs(b):
        x = b[0].to(torch.bfloat16).requires_grad_()
        w = b[2].to(torch.bfloat16).requires_grad_()
        return x, b[1], w

    if owned:
        graph_layer(graphed, *inputs(batches[0]))
    else:  # captured by its first call (a step of its own here, so that both layers start counting after it)
        x, idx, w = inputs(batches[0])
        graphed(x, idx, w).sum().backward()
        eager(*inputs(batches[0])).sum().backward()
    eager.pop_stats()
    graphed.pop_stats()  # the warm-up calls counted: start both from here
    same, sync_free = [], True
    for b in batches + batches[:1]:
        out = []
        for layer, ws in zip(layers, weights):
            layer.zero_grad(set_to_none=True)
            for p in ws:
                p.grad = None
            x, idx, w = inputs(b)
            if layer is graphed:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            try:
                y = layer(x, idx, w)
                (y * b[3].to(torch.bfloat16)).sum().backward()
            except RuntimeError:
                sync_free = False
                raise
            finally:
                torch.cuda.set_sync_debug_mode(0)
            out.append([y.detach(), x.grad, w.grad, *[p.grad for p in ws]])
        same.append([a is not None and torch.equal(a, c) for a, c in zip(*out)])
    # gradient accumulation over micro-batches: two calls without clearing .grad add up as the eager ones do
    acc = []
    for layer, ws in zip(layers, weights):
        layer.zero_grad(set_to_none=True)
        for p in ws:
            p.grad = None
        for b in batches[:2]:
            x, idx, w = inputs(b)
            (layer(x, idx, w) * b[3].to(torch.bfloat16)).sum().backward()
        acc.append([p.grad.clone() for p in ws])
    same.append([torch.equal(a, c) for a, c in zip(*acc)])
    (se, ce), (sg, cg) = eager.pop_stats(), graphed.pop_stats()
    keep = [i for i, n in enumerate(LAYER_STAT_NAMES) if n != "planner_ms"]
    stats_equal = torch.allclose(se[keep], sg[keep], rtol=1e-12, atol=1e-12)
    x, idx, _ = inputs(batches[0])
    with pytest.raises(ValueError, match="captured shapes"):
        graphed(x, idx, batches[0][2].to(torch.bfloat16))  # weights without grad
    y = graphed(*inputs(batches[0]))
    with pytest.raises(RuntimeError, match="before the backward of its previous call"):
        graphed(*inputs(batches[1]))
    y.sum().backward()
    return same, sync_free, (ce, cg), stats_equal, sg[LAYER_STAT_NAMES.index("planner_ms")].item()


@not_deepep
@pytest.mark.parametrize("owned", [True, False], ids=["graph_layer", "layer_graphs_expert_weights"])
def test_graphed_layer_replays_equal_the_eager_layer(owned):
    for same, sync_free, calls, stats_equal, planner_ms in run_ranks(_graphed_layer, WORLD, owned, backend="nccl"):
        assert sync_free
        assert all(all(s) for s in same), same
        assert calls == (6, 6) and stats_equal
        assert planner_ms == 0.0  # a replay plans nothing on the host


def test_triton_layout_equals_the_torch_layout_on_the_gpu():
    import layout_triton_check

    assert layout_triton_check.main("cuda") == 0


def test_fused_swiglu_activation_matches_reference_on_the_counted_rows():
    from topoep.runtime.experts import _act_grads, swiglu_act_reference
    from topoep.runtime.symm import swiglu_act, swiglu_act_grad

    torch.manual_seed(0)
    dev = torch.device("cuda")
    for cap, Fd, n in ((300, 768, 217), (64, 96, 0), (128, 100, 128)):
        h = torch.randn(cap, 2 * Fd, device=dev)
        ga = torch.randn(cap, Fd, device=dev)
        nt = torch.tensor([n], device=dev)
        ref, ref_g = swiglu_act_reference(h.double()), _act_grads(ga.double(), h.double())
        got = swiglu_act(h.bfloat16(), nt)[:n].double()
        got_g, got_act = swiglu_act_grad(ga.bfloat16(), h.bfloat16(), nt)
        got_g = got_g[:n].double()
        # the activation the backward pass writes beside the gradient is the forward's, bit for bit
        assert torch.equal(got_act[:n], swiglu_act(h.bfloat16(), nt)[:n])
        # within 2x the error of the same computation in bf16 torch ops (STYLE.md 3)
        tor = swiglu_act_reference(h.bfloat16())[:n].double()
        tor_g = _act_grads(ga.bfloat16(), h.bfloat16())[:n].double()
        if n:
            assert (got - ref[:n]).abs().max() <= 2 * (tor - ref[:n]).abs().max()
            assert (got_g - ref_g[:n]).abs().max() <= 2 * (tor_g - ref_g[:n]).abs().max()
