"""GPU tests (skipped without CUDA; run on the GPU machine): the grouped-GEMM expert path against the
per-group loop, and ExpertParallelMoE on 2 GPUs with NCCL against the dense reference for every policy
(one domain of 2, and 2 GPUs as 2 virtual domains), and that the net-benefit guard never synchronises
the host."""

import pytest
import torch

from distributed import gpus_for, run_ranks
from test_runtime_multirank import _layer_vs_reference
from topoep import POLICIES
from topoep.runtime.experts import swiglu_dgrad, swiglu_forward, swiglu_wgrad

pytestmark = pytest.mark.gpu


def test_grouped_mm_matches_per_group_loop():
    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    G, H, Fd = 6, 256, 128
    sizes = [37, 0, 128, 5, 0, 64]  # empty groups included
    A = sum(sizes)
    x = torch.randn(A, H, device=dev, dtype=dt)
    gy = torch.randn(A, H, device=dev, dtype=dt)
    W1 = torch.randn(G, 2 * Fd, H, device=dev, dtype=dt) * 0.05
    W2 = torch.randn(G, H, Fd, device=dev, dtype=dt) * 0.05
    grouped1, grouped2 = list(W1.unbind(0)), list(W2.unbind(0))  # stacked views: one _grouped_mm per run
    loop1, loop2 = [w.clone() for w in grouped1], [w.clone() for w in grouped2]  # separate tensors: loop
    y_g, h_g = swiglu_forward(x, sizes, grouped1, grouped2)
    y_l, h_l = swiglu_forward(x, sizes, loop1, loop2)
    torch.testing.assert_close(y_g, y_l, rtol=2e-2, atol=2e-2)
    gx_g, gh_g = swiglu_dgrad(gy, h_g, sizes, grouped1, grouped2)
    gx_l, gh_l = swiglu_dgrad(gy, h_l, sizes, loop1, loop2)
    torch.testing.assert_close(gx_g, gx_l, rtol=2e-2, atol=2e-2)
    o1 = torch.zeros_like(W1)
    o2 = torch.zeros_like(W2)
    swiglu_wgrad(x, h_g, gy, gh_g, sizes, list(o1.unbind(0)), list(o2.unbind(0)))
    l1 = [torch.zeros_like(w) for w in loop1]
    l2 = [torch.zeros_like(w) for w in loop2]
    swiglu_wgrad(x, h_l, gy, gh_l, sizes, l1, l2)
    torch.testing.assert_close(o1, torch.stack(l1), rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(o2, torch.stack(l2), rtol=3e-2, atol=3e-2)
    assert o1[1].abs().max() == 0 and o1[4].abs().max() == 0  # empty groups get no gradient
    # offsets from device-side sizes (the layer's path: no host-to-device copy) give the same results
    sd = torch.tensor(sizes, device=dev)
    y_d, h_d = swiglu_forward(x, sizes, grouped1, grouped2, sizes_dev=sd)
    assert torch.equal(y_d, y_g) and torch.equal(h_d, h_g)
    gx_d, gh_d = swiglu_dgrad(gy, h_g, sizes, grouped1, grouped2, sizes_dev=sd)
    assert torch.equal(gx_d, gx_g) and torch.equal(gh_d, gh_g)
    d1, d2 = torch.zeros_like(W1), torch.zeros_like(W2)
    swiglu_wgrad(x, h_g, gy, gh_g, sizes, list(d1.unbind(0)), list(d2.unbind(0)), sizes_dev=sd)
    assert torch.equal(d1, o1) and torch.equal(d2, o2)


@pytest.mark.skipif(not gpus_for(2), reason="needs 2 GPUs (or TOPOEP_GPU_SHARE=1 to let 2 ranks share one)")
@pytest.mark.parametrize("rpd", [2, 1])  # one domain; 2 GPUs as 2 virtual domains
def test_layer_on_two_gpus_matches_dense_reference(rpd):
    results = run_ranks(_layer_vs_reference, 2, rpd, list(POLICIES), [1, 2], 2.0, "cuda", backend="nccl")
    for policy in POLICIES:
        reps = [r[(policy, 2)]["replica_fraction"] for r in results]
        assert reps[0] == reps[1]
        if policy in ("topoep", "flexmoe") or (policy == "deepseek" and rpd > 1):  # deepseek: within a node
            assert reps[0] > 0


def test_guard_does_not_synchronise_the_host():
    from test_runtime_guard import hand_plan
    from topoep import Plan
    from topoep.runtime.guard import NetBenefitGuard

    p = hand_plan()
    dev = torch.device("cuda")
    p.topology.on(dev)  # the topology's one-time device copy
    plan = Plan(omega=p.omega.to(dev), topology=p.topology, num_slots=1, main_rank=p.main_rank.to(dev),
                slot_expert=p.slot_expert.to(dev), route=p.route.to(dev), policy="topoep", expert_bytes=1000,
                token_bytes=10)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        executed, fired, _, _ = NetBenefitGuard().select(plan, 1e-6, 3)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert fired.item() and executed.slot_expert.cpu().tolist() == [[-1], [-1]]


def test_backend_torch_groups_megatron_style_separate_expert_weights():
    """megatron's experts are separate parameters (no grouped GEMM over them as they are): backend torch
    stacks a copy per call (experts.grouped_copies), so the layer runs exactly as with one stacked
    parameter - bitwise the same output and weight gradients - instead of a loop over the active experts."""
    from topoep import ExpertParallelMoE, Topology
    from topoep.runtime.experts import grouped_copies

    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    E, H, Fd, T, K = 16, 256, 128, 200, 4
    fc1 = torch.randn(E, 2 * Fd, H, device=dev, dtype=dt) * 0.05
    fc2 = torch.randn(E, H, Fd, device=dev, dtype=dt) * 0.05
    lists = ([torch.nn.Parameter(w.clone()) for w in fc1], [torch.nn.Parameter(w.clone()) for w in fc2])
    assert grouped_copies(*lists, fc1) is not None  # separate tensors: stacked
    assert grouped_copies(list(fc1.unbind(0)), list(fc2.unbind(0)), fc1) is None  # one buffer already
    kw = dict(num_experts=E, hidden_size=H, ffn_hidden_size=Fd, topology=Topology(num_domains=1, ranks_per_domain=1),
              num_slots=0, policy="static", backend="torch", dtype=dt, device=dev)
    stacked = ExpertParallelMoE(**kw)
    with torch.no_grad():
        stacked.fc1.copy_(fc1)
        stacked.fc2.copy_(fc2)
    separate = ExpertParallelMoE(**kw, expert_weights=lambda: lists)
    x = torch.randn(T, H, device=dev, dtype=dt)
    idx = torch.randint(0, E, (T, K), device=dev)
    w = torch.softmax(torch.randn(T, K, device=dev), 1).to(dt)
    gy = torch.randn(T, H, device=dev, dtype=dt)
    ys, grads = [], []
    for layer in (stacked, separate):
        xr = x.clone().requires_grad_()
        y = layer(xr, idx, w)
        (y * gy).sum().backward()
        ys.append(y.detach())
        g1 = layer.fc1.grad if layer is stacked else torch.stack([p.grad for p in lists[0]])
        g2 = layer.fc2.grad if layer is stacked else torch.stack([p.grad for p in lists[1]])
        grads.append((xr.grad, g1, g2))
    assert torch.equal(ys[0], ys[1])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
