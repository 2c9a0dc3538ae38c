"""The net-benefit guard's pre-plan bound (`NetBenefitGuard.worth_planning`, its reference) as one Triton kernel.

The reference is about ten small torch operations (the static rank loads, their sum and maximum, the bound, the
comparison); a guarded layer runs it in every call's metadata graph, also where nothing is planned. Here one launch
does it for the default placement (rank r hosts experts r E_loc .. (r + 1) E_loc - 1): each program sums the
columns of a block of ranks over every source row (tiles of rows), so it holds those ranks' loads, and writes their
maximum and sum to a partial row; the program that arrives last at an atomic counter reduces the partials (the
counter's acquire-release makes the others' partials visible to it) and writes the decision: t_ffn (L_max -
ceil(mean)) > threshold, the bound one float64 multiplication and one comparison with a threshold made on the host,
as the reference does. The loads are integers: the decision equals the reference's on every input.
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
    def _worth_kernel(omega, consts, partial, counter, out, R, E, E_loc, NPROG, BLOCK_S: tl.constexpr,
                      BLOCK_RB: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr):
        """out bool[1]: t_ffn (L_max - ceil(mean)) > threshold; consts float64[2]: t_ffn, threshold (float64: a
        Python float argument would be fp32); partial int64[2 NPROG]; counter int32[1], zero on entry."""
        pid = tl.program_id(0)
        rk = pid * BLOCK_RB + tl.arange(0, BLOCK_RB)  # this program's ranks
        lv = tl.arange(0, BLOCK_L)
        col = rk[:, None] * E_loc + lv[None, :]  # [RB, L]: their experts
        cmask = (rk[:, None] < R) & (lv[None, :] < E_loc)
        sv = tl.arange(0, BLOCK_S)
        acc = tl.zeros([BLOCK_RB, BLOCK_L], dtype=tl.int64)
        s = 0
        while s < R:  # (while loops: Triton's interpreter runs them, not ranges over runtime bounds)
            rows = s + sv
            tile = tl.load(omega + rows[:, None, None].to(tl.int64) * E + col[None, :, :],
                           mask=(rows[:, None, None] < R) & cmask[None, :, :], other=0)
            acc += tl.sum(tile, 0)
            s += BLOCK_S
        load = tl.sum(acc, 1)  # [RB]; 0 past the last rank (loads are >= 0: neutral for the maximum)
        tl.store(partial + pid, tl.max(load, 0))
        tl.store(partial + NPROG + pid, tl.sum(load, 0))
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")  # releases this program's partials
        if arrived == NPROG - 1:  # the last program: every partial is visible (acquired above)
            pv = tl.arange(0, BLOCK_P)
            pm = pv < NPROG
            load_max = tl.max(tl.load(partial + pv, mask=pm, other=0, volatile=True), 0)
            total = tl.sum(tl.load(partial + NPROG + pv, mask=pm, other=0, volatile=True), 0)
            mean_ceil = (total + R - 1) // R
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
    e_loc = E // R
    BLOCK_L = _pow2(e_loc)
    BLOCK_RB = max(1, min(_pow2(R), 64 // BLOCK_L))  # about 64 columns per program
    BLOCK_S = max(1, min(_pow2(R), 4096 // (BLOCK_RB * BLOCK_L)))  # tiles of at most 4096 counts
    nprog = -(-R // BLOCK_RB)
    partial = torch.empty(2 * nprog, dtype=torch.int64, device=dev)
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    out = torch.empty(1, dtype=torch.bool, device=dev)
    _worth_kernel[(nprog,)](omega.contiguous(), consts, partial, counter, out, R, E, e_loc, nprog, BLOCK_S=BLOCK_S,
                            BLOCK_RB=BLOCK_RB, BLOCK_L=BLOCK_L, BLOCK_P=_pow2(nprog))
    return out.view(())
