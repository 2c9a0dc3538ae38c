"""Run by tests/test_runtime_guard.py in a subprocess with TRITON_INTERPRET=1 (Triton's interpreter runs the kernel on
CPU tensors; it must be set before triton is imported), and on a GPU as main("cuda"): the spread gate's update kernel
(topoep.runtime.gate_triton) against SpreadGate.record_reference over random call sequences (pre-plan bound on or
off, the spread planner run or not, the guard fired or not, spread candidate kept or not, savings around the
threshold, NaN before the first measurement). State and flag must be equal after every call (NaN where NaN). Prints
one line per case; exits 1 on the first difference."""

import sys

import torch

from topoep.runtime.guard import SpreadGate


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a == b) | (a.isnan() & b.isnan())).all()) if a.is_floating_point() else bool((a == b).all())


def main(device: str = "cpu") -> int:
    for c, (probe, spread_s) in enumerate([(2, 0.0), (3, 1.0), (5, 0.25), (16, 1e-4)]):
        g = torch.Generator().manual_seed(c)
        kernel, ref = SpreadGate(probe, spread_s), SpreadGate(probe, spread_s)
        on_calls = runs = 0
        for step in range(60):
            worth = torch.rand((), generator=g) < 0.85
            w = worth.to(device)
            ran_k, ran_r = kernel.enable(w), ref.enable(w)
            if not bool(ran_k == ran_r):
                print(f"case {c}: step {step}: enable DIFFERENT {bool(ran_k)} {bool(ran_r)}", flush=True)
                return 1
            fired = (torch.rand((), generator=g) < 0.2).to(device)
            saved = (torch.rand((), generator=g, dtype=torch.float64) * 4).to(device)
            cost = (torch.rand((), generator=g, dtype=torch.float64) * 2).to(device)
            choice = torch.randint(0, 4, (), generator=g).to(device)
            runs += int(ran_r)
            kernel.record(w, ran_k, fired, saved, cost, choice, 2)
            ref.record_reference(w, ran_r, fired, saved, cost, choice, 2)
            if not (same(kernel.state, ref.state) and same(kernel.flag, ref.flag)):
                print(f"case {c}: step {step}: DIFFERENT {kernel.state.tolist()} {kernel.flag.tolist()} "
                      f"{ref.state.tolist()} {ref.flag.tolist()}", flush=True)
                return 1
            on_calls += int(ref.state[0])
        print(f"case {c}: probe={probe} spread_s={spread_s}: 60 calls equal, on after {on_calls}, runs {runs}",
              flush=True)
    print("4 cases passed: the kernel's state equals the reference's")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "cpu"))
