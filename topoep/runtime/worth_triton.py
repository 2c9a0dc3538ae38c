"""The net-benefit guard's pre-plan bound (`NetBenefitGuard.worth_planning`, its reference) as one Triton kernel.

The reference is about ten small torch operations (the static rank loads, their sum and maximum, the bound, the
comparison); a guarded layer runs it in every call's metadata graph, also where nothing is planned. Here one program
does it for the default placement (rank r hosts experts r E_loc .. (r + 1) E_loc - 1): the expert totals over the
sources in tiles of rows, the rank loads from them (read back from a scratch row after a barrier of the program),
their maximum and sum, then the bound in float64. The loads are integers and the bound one float64 multiplication
and one comparison with a threshold made on the host, as the reference does: the decision equals the reference's on
every input.
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
    def _worth_kernel(omega, consts, scratch, out, R, E, E_loc, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr):
        """out bool[1]: t_ffn (L_max - ceil(mean)) > threshold; consts float64[2]: t_ffn, threshold (float64: a
        Python float argument would be fp32); scratch int64[>= E]."""
        ev = tl.arange(0, BLOCK_E)
        em = ev < E
        sv = tl.arange(0, BLOCK_S)
        total = tl.zeros([BLOCK_E], dtype=tl.int64)
        s = 0
        while s < R:  # (while loops: Triton's interpreter runs them, not ranges over runtime bounds)
            rows = s + sv
            tile = tl.load(omega + rows[:, None].to(tl.int64) * E + ev[None, :],
                           mask=(rows[:, None] < R) & em[None, :], other=0)
            total += tl.sum(tile, 0)
            s += BLOCK_S
        tl.store(scratch + ev, total, mask=em)
        tl.debug_barrier()
        rv = tl.arange(0, BLOCK_R)
        lv = tl.arange(0, BLOCK_L)
        mask = (rv[:, None] < R) & (lv[None, :] < E_loc)
        load = tl.sum(tl.load(scratch + rv[:, None] * E_loc + lv[None, :], mask=mask, other=0), 1)
        load_max = tl.max(tl.where(rv < R, load, 0), 0)
        mean_ceil = (tl.sum(load, 0) + R - 1) // R
        bound = tl.load(consts + 0) * (load_max - mean_ceil).to(tl.float64)
        tl.store(out, bound > tl.load(consts + 1))


_CONSTS: dict = {}


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def usable(omega: torch.Tensor, main_rank: torch.Tensor) -> bool:
    """Whether the kernel applies: Triton importable, the default placement (main_rank is
    `topoep.plan.default_main_rank`'s cached tensor), R >= 2, one program's tiles within reach (E <= 65536)."""
    from topoep.plan import default_main_rank

    R, E = omega.shape
    return (triton is not None and R >= 2 and E % R == 0 and E <= 65536
            and main_rank is default_main_rank(E, R, omega.device))


def worth_planning_triton(omega: torch.Tensor, t_ffn: float, threshold: float) -> torch.Tensor:
    """bool 0-d on omega's device: t_ffn (max_r L_r - ceil(sum_r L_r / R)) > threshold, L_r rank r's load with main
    instances only under the default placement (`NetBenefitGuard.worth_planning`, whose threshold is planning plus
    one replica fetch on the cheapest link). No host synchronisation; graph-capturable."""
    R, E = omega.shape
    if triton is None or R < 2 or E % R or E > 65536:
        raise ValueError(f"the bound's kernel needs Triton and omega [R >= 2, E] with E a multiple of R up to 65536, "
                         f"got {list(omega.shape)}; use NetBenefitGuard.worth_planning's torch path")
    dev = omega.device
    key = (float(t_ffn), float(threshold), torch.device(dev))
    consts = _CONSTS.get(key)
    if consts is None:  # made once per value: a metadata graph's capture then copies nothing from the host
        consts = _CONSTS[key] = torch.tensor(key[:2], dtype=torch.float64, device=dev)
    scratch = torch.empty(E, dtype=torch.int64, device=dev)
    out = torch.empty(1, dtype=torch.bool, device=dev)
    BLOCK_E = _pow2(E)
    BLOCK_S = max(1, min(_pow2(R), 16384 // BLOCK_E))
    _worth_kernel[(1,)](omega.contiguous(), consts, scratch, out, R, E, E // R, BLOCK_S=BLOCK_S, BLOCK_E=BLOCK_E,
                        BLOCK_R=_pow2(R), BLOCK_L=_pow2(E // R))
    return out.view(())
