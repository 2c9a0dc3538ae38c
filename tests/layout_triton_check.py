"""Run by tests/test_cuda_layout.py in a subprocess with TRITON_INTERPRET=1 (Triton's interpreter runs the
kernels on CPU tensors; it must be set before triton is imported): `layout_triton.fused_layout` against
the torch reference (`layout.send_layout` + `layout.receive_positions`) on random plans, bit for bit.
Prints one line per case and exits 1 on the first difference. tests/test_cuda_backend_gpu.py calls
main("cuda") for the same check on the GPU (compiled kernels)."""

import sys

import torch

from topoep import Topology, solve
from topoep.runtime.layout import group_counts, receive_positions, send_layout
from topoep.runtime.layout_triton import BLOCK, fused_layout
from topoep.workloads import biased_topk


def cases():
    # (ranks, ranks per domain, experts, slots, tokens, top-k, skew, policy)
    yield 1, 1, 8, 0, 40, 2, 0.0, "static"
    yield 2, 2, 16, 2, 96, 4, -3.0, "topoep"
    yield 2, 1, 16, 2, 3 * BLOCK // 4 + 5, 4, -2.0, "topoep"  # blocks of several experts, one partial
    yield 4, 2, 32, 3, 70, 8, -4.0, "topoep"
    yield 4, 4, 24, 1, 33, 3, -1.0, "topoep"
    yield 8, 4, 64, 2, 64, 6, -3.0, "topoep"
    yield 8, 8, 40, 4, 50, 5, -2.5, "static"
    yield 4, 2, 16, 2, 0, 2, 0.0, "topoep"  # no assignments


def main(device: str = "cpu") -> int:
    for n, (R, rpd, E, N, T, k, skew, policy) in enumerate(cases()):
        topo = Topology(num_domains=R // rpd, ranks_per_domain=rpd)
        layout = "concentrated" if n % 2 else "random"
        idx = list(biased_topk(R, E, T, k, skew, seed=n, layout=layout).unbind(0)) if T else \
            [torch.zeros(0, k, dtype=torch.int64) for _ in range(R)]
        omega = torch.stack([torch.bincount(i.reshape(-1), minlength=E) for i in idx])
        idx = [i.to(device) for i in idx]
        plan = solve(omega.to(device), topo, num_slots=N, policy=policy, expert_bytes=1000, token_bytes=10)
        C = group_counts(plan)
        for rank in range(R):
            _, key_ref, order_ref = send_layout(idx[rank], plan, rank)
            dest_ref, pos_ref, slot_ref = receive_positions(C, key_ref, rank, E // R)
            got = fused_layout(idx[rank], plan, rank, C)
            for name, g, r in zip(("key", "order", "dest", "pos", "is_slot"), got,
                                  (key_ref, order_ref, dest_ref, pos_ref, slot_ref)):
                if not (g.dtype == r.dtype and torch.equal(g, r)):
                    print(f"case {n} (R={R} E={E} N={N} T={T} k={k} {policy}) rank {rank}: {name} differs "
                          f"({g.dtype} vs {r.dtype})\n"
                          f"  got {g.tolist()[:40]}\n  ref {r.tolist()[:40]}")
                    return 1
        print(f"case {n}: R={R} E={E} N={N} T={T} k={k} {policy}: equal on every rank "
              f"({int(plan.slot_expert.ge(0).sum())} replicas)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
