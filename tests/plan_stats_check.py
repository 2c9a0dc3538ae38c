"""Run by tests/test_stats_triton.py in a subprocess with TRITON_INTERPRET=1 (Triton's interpreter runs the kernel on
CPU tensors; it must be set before triton is imported), and by its GPU test as main("cuda"): the plan statistics
kernel (topoep.runtime.stats_triton) against topoep.metrics.plan_stats on plans of several policies, sizes and
topologies (with and without slots and replicas). Counts exactly, the cost sums within 1e-12 relative. Prints one
line per case; exits 1 on the first difference."""

import sys

import torch

from topoep import Topology, solve
from topoep.metrics import DEFAULT_T_FFN, STAT_NAMES, plan_stats
from topoep.runtime.stats_triton import plan_stats_triton


def cases():
    # (domains, ranks per domain, experts per rank, slots, policy, skew of the routing)
    yield 1, 1, 8, 2, "static", 0.0
    yield 2, 2, 4, 2, "topoep", 2.0
    yield 2, 4, 3, 1, "topoep_plus", 3.0
    yield 4, 2, 5, 0, "static", 1.0
    yield 1, 3, 6, 3, "topoep", 4.0
    yield 2, 3, 2, 2, "topoep_plus", 0.5


def main(device: str = "cpu") -> int:
    for c, (D, rpd, e_loc, N, policy, skew) in enumerate(cases()):
        g = torch.Generator().manual_seed(c)
        R = D * rpd
        E = R * e_loc
        pop = torch.exp(skew * torch.rand(E, generator=g))
        omega = torch.poisson(pop[None, :].expand(R, E) * 20, generator=g).to(torch.int64)
        plan = solve(omega.to(device), Topology(num_domains=D, ranks_per_domain=rpd), policy=policy, num_slots=N,
                     expert_bytes=9437184, token_bytes=4096)
        want = plan_stats(plan).cpu()
        got = plan_stats_triton(plan, DEFAULT_T_FFN).cpu()
        close = (got - want).abs() <= 1e-12 * want.abs() + 1e-300
        bad = [name for name, ok in zip(STAT_NAMES, close.tolist()) if not ok]
        reps = int((plan.slot_expert >= 0).sum())
        print(f"case {c}: R={R} E={E} N={N} {policy} replicas={reps}: "
              + ("equal" if not bad else "DIFFERENT: " + ", ".join(f"{b} {float(want[STAT_NAMES.index(b)]):.17g} "
                                                                   f"{float(got[STAT_NAMES.index(b)]):.17g}"
                                                                   for b in bad)), flush=True)
        if bad:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "cpu"))
