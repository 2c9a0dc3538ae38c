"""Transport deepep (topoep/runtime/deepep.py) on the CPU, without DeepEP installed:
- the conversion of a plan to DeepEP's inputs: every assignment gets the id of an instance of its own expert on the
  rank the route gives, and the ids' counts equal the route (C[s, d, g]) for every source, policy and slot count;
- the errors: DeepEP missing (or its V1) names the install script; the config refuses what the transport cannot do;
- the whole layer (backend cuda's metadata, the autograd function with the slot rows, fetch, reload and gradient
  return) over gloo with `ReferenceElasticBuffer` standing in for DeepEP: outputs and gradients of every policy within
  2x backend torch's bf16 error of the fp64 reference, as the other transports' CPU tests check.
The same layer on DeepEP itself runs on GPUs: tests/test_cuda_backend_gpu.py with TOPOEP_GPU_TRANSPORT=deepep."""

import sys

import pytest
import torch

from distributed import run_ranks
from test_cuda_backend_cpu import _errors, _topology, problem
from test_cuda_backend_gpu import E_LOC, FD, H, _routing


def _instance_of(ids: torch.Tensor, R: int, E: int, N: int) -> torch.Tensor:
    """The physical instance of DeepEP ids (the inverse of deepep_expert_ids' numbering, written out)."""
    E_loc = E // R
    G = E_loc + N
    d, g = ids // G, ids % G
    return torch.where(g < E_loc, d * E_loc + g, E + d * N + (g - E_loc))


@pytest.mark.parametrize("policy", ["static", "topoep", "topoep_plus", "deepseek"])
@pytest.mark.parametrize("slots", [0, 2])
def test_expert_ids_follow_the_route(policy, slots):
    from topoep import Topology, solve
    from topoep.runtime.deepep import deepep_expert_counts, deepep_expert_ids, deepep_num_experts
    from topoep.runtime.layout import group_counts

    R, E, k, T = 4, 16, 4, 64
    topo = Topology(num_domains=2, ranks_per_domain=2)
    g = torch.Generator().manual_seed(5)
    bias = torch.zeros(E)
    bias[:3] = 3.0  # hot experts on rank 0: replicas where there are slots
    idx = [torch.topk(torch.randn(T, E, generator=g) + bias, k, dim=1).indices for _ in range(R)]
    omega = torch.stack([torch.bincount(i.reshape(-1), minlength=E) for i in idx])
    plan = solve(omega, topo, num_slots=slots, policy=policy)
    G = E // R + slots
    assert deepep_num_experts(plan) == R * G
    C = group_counts(plan)
    for s in range(R):
        ids = deepep_expert_ids(idx[s], plan, s)
        assert ids.shape == (T, k) and ids.dtype == torch.int64
        assert int(ids.min()) >= 0 and int(ids.max()) < R * G
        inst = _instance_of(ids, R, E, slots)
        assert torch.equal(plan.instance_expert[inst], idx[s])  # an instance of the assignment's own expert
        assert torch.equal(ids // G, plan.instance_rank[inst])  # on the rank that hosts it (DeepEP's blocks)
        assert torch.equal(torch.bincount(ids.reshape(-1), minlength=R * G), C[s].reshape(-1))  # the route
        assert torch.equal(torch.bincount(inst.reshape(-1), minlength=plan.num_instances), plan.route[s])
    assert torch.equal(deepep_expert_counts(plan), C.sum(0).reshape(-1))
    if slots and policy != "static":
        assert int(C[:, :, E // R:].sum()) > 0  # replicas served rows: the slot ids were exercised


def test_missing_deepep_names_the_install(monkeypatch):
    from topoep.runtime.deepep import import_deep_ep

    monkeypatch.setitem(sys.modules, "deep_ep", None)  # `import deep_ep` raises ImportError
    with pytest.raises(ImportError, match="tools/build_deepep.sh"):
        import_deep_ep()
    v1 = type(sys)("deep_ep")
    v1.Buffer, v1.__version__ = object, "1.0.0"
    monkeypatch.setitem(sys.modules, "deep_ep", v1)
    with pytest.raises(ImportError, match="no ElasticBuffer"):
        import_deep_ep()


def test_config_refuses_what_deepep_cannot_do():
    from topoep import LayerConfig

    ok = LayerConfig(backend="cuda", transport="deepep", capacity_factor=None)
    assert ok.transport == "deepep"
    for bad, match in ((dict(backend="cuda", transport="deepep"), "capacity_factor=null"),
                       (dict(backend="torch", transport="deepep", capacity_factor=None), "backend=cuda"),
                       (dict(backend="cuda", transport="deepep", capacity_factor=None, num_chunks=2), "num_chunks"),
                       (dict(backend="cuda", transport="deepep", capacity_factor=None, layer_graphs=True),
                        "layer_graphs=false"),
                       (dict(backend="cuda", deepep_deterministic=True), "transport=deepep")):
        with pytest.raises(ValueError, match=match):
            LayerConfig(**bad)


def _layer(E, policy, backend, fc1, fc2, lo, hi, world, transport):
    from topoep import ExpertParallelMoE

    kw = dict(_cpu_harness=True, transport=transport) if backend == "cuda" else {}
    layer = ExpertParallelMoE(num_experts=E, hidden_size=H, ffn_hidden_size=FD, topology=_topology(world),
                              num_slots=2, policy=policy, backend=backend, dtype=torch.bfloat16, device="cpu",
                              guard=False, capacity_factor=None, **kw)
    with torch.no_grad():
        layer.fc1.copy_(fc1[lo:hi])
        layer.fc2.copy_(fc2[lo:hi])
    return layer


def _policies(rank, world, policies):
    E, lo, hi, fc1, fc2, (y_ref, *ref), (x, idx, w, gy) = problem(rank, world)
    out = {}
    for policy in policies:
        for backend, transport in (("torch", "peer"), ("cuda", "deepep"), ("cuda", "peer")):
            layer = _layer(E, policy, backend, fc1, fc2, lo, hi, world, transport)
            ys = []
            for _ in range(2):  # the second call accumulates into the weights' gradients
                xr, wr = x.to(torch.bfloat16).requires_grad_(), w.to(torch.bfloat16).requires_grad_()
                y = layer(xr, idx, wr)
                (y * gy.to(torch.bfloat16)).sum().backward()
                ys.append(y.detach())
            got = [xr.grad, wr.grad, layer.fc1.grad / 2, layer.fc2.grad / 2]
            errs = _errors(got, ref, lo, hi)
            errs.append(float((ys[-1].double() - y_ref).abs().max()))
            out[(policy, backend, transport)] = (errs, layer.stats_dict()["replica_fraction"],
                                                 torch.equal(ys[0], ys[1]))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_deepep_layer_matches_backend_torch_within_bf16_error(world):
    policies = ["static", "topoep", "topoep_plus", "deepseek"]
    for out in run_ranks(_policies, world, policies):
        for policy in policies:
            errs_t, rep_t, _ = out[(policy, "torch", "peer")]
            errs_d, rep_d, repeatable = out[(policy, "cuda", "deepep")]
            assert repeatable and rep_d == rep_t == out[(policy, "cuda", "peer")][1]  # the same plan
            for what, ed, et in zip(("grad x", "grad w", "grad fc1", "grad fc2", "y"), errs_d, errs_t):
                assert ed <= 2 * et + 1e-6, f"{policy} {what}: error {ed:.3g} > 2 x torch's {et:.3g}"
        if world == 4:  # replicas served tokens: the slot path ran (EP 2 with this skew plans none)
            assert out[("topoep", "cuda", "deepep")][1] > 0 and out[("deepseek", "cuda", "deepep")][1] > 0


def _reference_contract(rank, world):
    """ReferenceElasticBuffer's rows per local expert equal the plan's counts, and combine returns the sums."""
    import torch.distributed as dist

    from topoep import solve
    from topoep.runtime.deepep import (ReferenceElasticBuffer, deepep_expert_counts, deepep_expert_ids,
                                       deepep_num_experts)

    E = world * E_LOC
    data = _routing(world, 4, 3.0, "cpu")
    omega = torch.stack([torch.bincount(d[1].reshape(-1), minlength=E) for d in data])
    plan = solve(omega, _topology(world), num_slots=2, policy="topoep")
    x, idx, w, _ = data[rank]
    buf = ReferenceElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=x.shape[0])
    ids = deepep_expert_ids(idx, plan, rank)
    rows, _, rw, h, _ = buf.dispatch(x, topk_idx=ids, topk_weights=w, num_experts=deepep_num_experts(plan),
                                     do_expand=True, do_cpu_sync=False)
    G = E_LOC + 2
    counts = torch.diff(h.psum_num_recv_tokens_per_expert.long(), prepend=torch.zeros(1, dtype=torch.long))
    n = int(h.psum_num_recv_tokens_per_expert[-1])
    y, wc, _ = buf.combine(rows * rw.unsqueeze(1), h, topk_weights=rw)
    return (torch.equal(counts, deepep_expert_counts(plan)[rank * G:(rank + 1) * G]),
            bool(torch.isnan(rows[n:]).all()), float((y - (x * w.sum(1, keepdim=True))).abs().max()),
            torch.equal(wc, w.float()))


def test_reference_buffer_keeps_the_contract():
    for same_counts, nan_tail, err, same_w in run_ranks(_reference_contract, 4):
        assert same_counts and nan_tail and same_w
        assert err < 1e-5


def test_release_buffers_destroys_each_deepep_buffer_once():
    from topoep.runtime.deepep import DeepEPWorkspace, release_buffers

    class Buffer:
        destroyed = 0

        def destroy(self):
            Buffer.destroyed += 1

    ws = object.__new__(DeepEPWorkspace)
    ws.buffer = Buffer()
    DeepEPWorkspace._shared[("test", 1)] = ws
    try:
        release_buffers()
        release_buffers()  # nothing left: a second call destroys nothing
        assert Buffer.destroyed == 1 and not DeepEPWorkspace._shared
    finally:
        DeepEPWorkspace._shared.pop(("test", 1), None)
