"""Run by tests/test_worth_triton.py in a subprocess with TRITON_INTERPRET=1 (Triton's interpreter runs the kernel on
CPU tensors; it must be set before triton is imported), and by its GPU test as main("cuda"): the pre-plan bound's
kernel (topoep.runtime.worth_triton) against the torch form of NetBenefitGuard.worth_planning on routings of several
sizes and skews, with thresholds at, just below and just above each bound (the decision must flip where the
reference's does). Prints one line per case; exits 1 on the first difference."""

import sys

import torch

from topoep import Topology, workloads
from topoep.plan import default_main_rank
from topoep.planners.common import static_rank_load
from topoep.runtime.worth_triton import worth_planning_triton


def cases():
    # (ranks, experts per rank, tokens per rank, router skew)
    yield 2, 4, 64, 0.0
    yield 4, 8, 512, -2.0
    yield 8, 3, 100, -4.0
    yield 16, 8, 4096, -1.0
    yield 32, 20, 4096, -2.5
    yield 128, 5, 1024, -3.0
    yield 8, 16, 0, 0.0  # no tokens
    yield 4, 6, -1, 0.0  # random counts (T < 0): totals that R does not divide
    yield 12, 2, -1, 0.0


def main(device: str = "cpu") -> int:
    for c, (R, e_loc, T, skew) in enumerate(cases()):
        E = R * e_loc
        if T > 0:
            omega = workloads.biased_routing(R, E, T, min(8, E), skew, seed=c)
        elif T == 0:
            omega = torch.zeros(R, E, dtype=torch.int64)
        else:
            omega = torch.randint(0, 7, (R, E), generator=torch.Generator().manual_seed(c))
        omega = omega.to(device)
        load = static_rank_load(omega, default_main_rank(E, R, device), R)
        diff = int(load.max()) - (int(load.sum()) + R - 1) // R
        t_ffn = 45.3e-9
        bound = t_ffn * float(diff)
        for threshold in (bound, bound * (1 - 1e-12), bound * (1 + 1e-12), 0.0, -1.0, 1.0):
            want = bound > threshold
            got = bool(worth_planning_triton(omega, t_ffn, threshold).item())
            same = got == want
            print(f"case {c}: R={R} E={E} diff={diff} threshold={threshold!r}: "
                  + ("equal" if same else f"DIFFERENT: kernel {got}, reference {want}"), flush=True)
            if not same:
                return 1
    # the guard takes the kernel where it applies and decides as its torch path does
    from topoep.runtime.guard import NetBenefitGuard

    topo = Topology(num_domains=2, ranks_per_domain=4)
    omega = workloads.biased_routing(8, 64, 512, 8, -3.0, seed=9).to(device)
    guard = NetBenefitGuard(plan_s=0.0)
    mr = default_main_rank(64, 8, device)
    got = bool(guard.worth_planning(omega, topo, mr, 1e-6, 1000, 1).item())
    want = bool(guard.worth_planning(omega, topo, mr.clone(), 1e-6, 1000, 1).item())  # a copy: the torch path
    print(f"case guard: kernel {got}, torch {want}: " + ("equal" if got == want else "DIFFERENT"), flush=True)
    return 0 if got == want else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "cpu"))
