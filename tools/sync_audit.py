"""Find every host synchronisation in one forward + backward of the `cuda`-backend layer on 2 GPUs
(GPU machine; TOPOEP_GPU_WORLD=1 for one): runs under torch.cuda.set_sync_debug_mode("warn") and prints the
Python stack of each synchronising call. Two layers: with 2 replica slots, and with none (the capacity step cannot
move the hot rank's rows: they go through the spill kernels at EP 2 and more). The layer is the GPU tests' (tests/test_cuda_backend_gpu.py): the same
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

    dev = _setup(rank)
    found = []

    def show(message, category, filename, lineno, file=None, line=None):
        found.append(f"{message}\n" + "".join(traceback.format_stack(limit=12)[:-1]))

    for slots in (2, 0):
        layer = ExpertParallelMoE(num_experts=world * E_LOC, hidden_size=H, ffn_hidden_size=FD, topology=_topology(),
                                  num_slots=slots, policy="topoep", backend="cuda", dtype=torch.bfloat16, device=dev,
                                  **cuda_options())
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
    return found


if __name__ == "__main__":
    for rank, found in enumerate(run_ranks(_audit, int(os.environ.get("TOPOEP_GPU_WORLD", "2")), backend="nccl")):
        print(f"rank {rank}: {len(found)} synchronising calls")
        for f in found[:20]:
            print(f)
