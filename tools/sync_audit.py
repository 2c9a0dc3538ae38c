"""Find every host synchronisation in one forward + backward of the `cuda`-backend layer on 2 GPUs
(GPU machine; TOPOEP_GPU_WORLD=1 for one): runs under torch.cuda.set_sync_debug_mode("warn") and prints the
Python stack of each synchronising call. Three layers: topoep with 2 replica slots; with none (the capacity step
cannot move the hot rank's rows: they go through the spill kernels at EP 2 and more); and guarded topoep_plus with
plus_spread and plus_peers (its five planners at once, the guard and the spread gate, whose probe runs the spread
planner on the audited second call). The layer is the GPU tests' (tests/test_cuda_backend_gpu.py): the same
TOPOEP_GPU_WORLD, TOPOEP_GPU_RPD (virtual domains), TOPOEP_GPU_TRANSPORT, TOPOEP_GPU_CHUNKS, TOPOEP_GPU_PREFETCH and
TOPOEP_GPU_SHARE (the test variants of tests/test_cuda_backend_gpu.py).
Usage: python tools/sync_audit.py"""

import os
import sys
import traceback
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import torch  # noqa: E402

from distributed import run_ranks  # noqa: E402


def _audit(rank, world):
    from test_cuda_backend_gpu import E_LOC, FD, H, _routing, _setup, _topology, cuda_options
    from topoep import ExpertParallelMoE
    from topoep.runtime import NetBenefitGuard

    dev = _setup(rank)
    found, planned = [], None

    def show(message, category, filename, lineno, file=None, line=None):
        found.append(f"{message}\n" + "".join(traceback.format_stack(limit=12)[:-1]))

    spread = dict(policy="topoep_plus", guard=NetBenefitGuard(plan_s=0.0, transfer_latency_s=0.0, spread_plan_s=0.0),
                  plus_spread=True, plus_peers=True)
    for slots, kw in ((2, dict(policy="topoep")), (0, dict(policy="topoep")), (2, spread)):
        layer = ExpertParallelMoE(num_experts=world * E_LOC, hidden_size=H, ffn_hidden_size=FD, topology=_topology(),
                                  num_slots=slots, backend="cuda", dtype=torch.bfloat16, device=dev,
                                  **kw, **cuda_options())
        for i, b in enumerate(_routing(world, s, 3.0, dev)[rank] for s in range(2)):
            x, idx, w, gy = (t.to(dev) for t in b)
            if i == 1:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("warn")
                warnings.showwarning = show
                warnings.simplefilter("always")
            xr = x.to(torch.bfloat16).requires_grad_()
            (layer(xr, idx, w.to(torch.bfloat16)) * gy.to(torch.bfloat16)).sum().backward()
            torch.cuda.set_sync_debug_mode(0)
        if kw is spread:  # the audited call ran the spread planner (the gate's probe)
            planned = layer.stats_dict()["spread_planned"]
    return found, planned


if __name__ == "__main__":
    for rank, (found, planned) in enumerate(run_ranks(_audit, int(os.environ.get("TOPOEP_GPU_WORLD", "2")),
                                                      backend="nccl")):
        print(f"rank {rank}: {len(found)} synchronising calls (the plus_spread layer's spread_planned: {planned})")
        for f in found[:20]:
            print(f)
