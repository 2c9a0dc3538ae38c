"""The spread gate's update (`topoep.runtime.guard.SpreadGate.record`, its torch reference) as one Triton kernel.

The reference is about twenty-five small torch operations on 0-d tensors; a layer with plus_spread runs it in every
planned call's metadata graph, where each costs a launch. Here one program loads the gate's state and the call's
guard outcome, writes the new state in place and the flag that the next call's `enable` ands with the pre-plan
bound's verdict. The comparisons are the reference's, on the same float64 values (a NaN compares false in both): the
state equals the reference's on every input.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only environments: the module imports, the kernel is unavailable
    triton = None

if triton is not None:

    @triton.jit
    def _gate_kernel(state, flag, worth, ran, fired, saved, cost, choice, spread_s, first_spread, probe):
        """state float64[4] (on, calls since the last probe, net_other, net_spread), updated in place; flag bool[1]:
        whether the next call runs the spread planner if the pre-plan bound lets it; worth, ran, fired bool[1];
        saved, cost, spread_s float64[1]; choice int64[1]."""
        on = tl.load(state + 0)
        since = tl.load(state + 1)
        net_other = tl.load(state + 2)
        net_spread = tl.load(state + 3)
        w = tl.load(worth) != 0
        r = tl.load(ran) != 0
        fv = tl.load(fired)
        s = tl.load(spread_s)
        net = tl.where(fv != 0, 0.0, tl.load(saved) - tl.load(cost))
        kept = (tl.load(choice) >= first_spread) & (fv == 0)
        new_spread = tl.where(r, tl.where(kept, net, -float("inf")), net_spread)
        new_other = tl.where(r, net_other, net)
        new_on = tl.where(r, kept & (net - net_other > s), (on > 0) & (net_spread - net > s))
        new_since = tl.where(since + 1 >= probe, 0.0, since + 1)
        on2 = tl.where(w, new_on.to(tl.float64), on)
        since2 = tl.where(w, new_since, since)
        tl.store(state + 0, on2)
        tl.store(state + 1, since2)
        tl.store(state + 2, tl.where(w, new_other, net_other))
        tl.store(state + 3, tl.where(w, new_spread, net_spread))
        tl.store(flag, (on2 > 0) != (since2 + 1 >= probe))


def usable(state: torch.Tensor) -> bool:
    """Whether the kernel applies: Triton importable and the state on a GPU (or Triton's interpreter running)."""
    import os

    return triton is not None and (state.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def record_triton(state: torch.Tensor, flag: torch.Tensor, worth: torch.Tensor, ran: torch.Tensor,
                  fired: torch.Tensor, saved: torch.Tensor, cost: torch.Tensor, choice: torch.Tensor,
                  spread_s: torch.Tensor, first_spread: int, probe: int) -> None:
    """`SpreadGate.record` in one launch (module docstring): state and flag updated in place. The scalars are 0-d or
    one-element device tensors (saved, cost, spread_s float64; choice int64; the rest bool). No host
    synchronisation; graph-capturable."""
    _gate_kernel[(1,)](state, flag, worth.reshape(1), ran.reshape(1), fired.reshape(1),
                       saved.to(torch.float64).reshape(1), cost.to(torch.float64).reshape(1),
                       choice.to(torch.int64).reshape(1), spread_s, int(first_spread), int(probe))
