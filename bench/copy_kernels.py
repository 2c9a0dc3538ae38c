"""The replica copy kernels of backend cuda's peer transport (topoep/runtime/symm.py) on one GPU, against torch's
copy of the same bytes: how fast a kernel moves an expert's weights where no link limits it (HBM to HBM), for its
16-byte accesses (ALIGN 16, `symm._aligned`) and its one-element ones (ALIGN 2, where a weight is not aligned).

    python bench/copy_kernels.py [--slots 8] [--hidden 2048] [--ffn 768] [--runs 20]

One rank: the fetch kernels (`_push_slots_kernel` from the homes, `_push_slots_async_kernel` copy by copy) copy N
experts' weights into N slots of a local buffer, the return kernel (`_push_grads_kernel`) N slots' gradients into
N regions, and the homes' sum (`_reduce_grads_kernel`) adds N regions onto one expert in fp32. Each result is
checked against torch once. GB/s: bytes written / time (the sum: bytes read); median of --runs CUDA-event timings
after warm-up. Across GPUs the link (NVLink, about 450 GB/s per direction on H100/H200) is the limit, far below
HBM: a kernel at HBM speed here does not slow a fetch; one far below it might. Writes results/copy_kernels.{md,json}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, command, markdown_table, median_cuda_ms, parse_options, run_info, write_json  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, default=8, help="experts copied per call (N)")
    ap.add_argument("--hidden", type=int, default=2048, help="hidden size (Qwen3-30B-A3B: 2048)")
    ap.add_argument("--ffn", type=int, default=768, help="expert FFN size (Qwen3-30B-A3B: 768)")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--name", default="copy_kernels")
    ap.add_argument("--out", type=Path, default=REPO / "results")
    args = parse_options(ap, argv)
    if args.slots < 1 or args.hidden < 1 or args.ffn < 1 or args.runs < 1:
        ap.error("--slots, --hidden, --ffn and --runs must be >= 1")
    return args


def measure(args, dev: torch.device, timer=median_cuda_ms, programs: int | None = None) -> list[dict]:
    """The table's rows on `dev` (CUDA; the CPU under TRITON_INTERPRET=1 with another `timer` and `programs`, as the
    CPU test runs it)."""
    import triton

    from topoep.runtime import symm as S

    N, H, F = args.slots, args.hidden, args.ffn
    numel = 2 * F * H  # fc1 of one expert (fc2 moves half of it)
    W = torch.randn(N, numel, device=dev).to(torch.bfloat16)  # the home's experts 0..N-1 (e_loc = N, rank 0)
    slots = torch.zeros_like(W)
    se = torch.arange(N, device=dev)  # slot j of rank 0 holds expert j
    bases = torch.tensor([slots.data_ptr()], dtype=torch.int64, device=dev)
    ptrs = S._expert_ptrs(W)
    grid = (N, triton.cdiv(numel, S.COPY_CHUNK))
    programs = programs or torch.cuda.get_device_properties(dev).multi_processor_count
    flags = torch.zeros(N, triton.cdiv(numel, S.COPY_CHUNK), dtype=torch.int32, device=dev)
    flag_bases = torch.tensor([flags.data_ptr()], dtype=torch.int64, device=dev)
    epoch = torch.zeros(1, dtype=torch.int32, device=dev)
    count = torch.tensor(N, dtype=torch.int64, device=dev)
    ret = torch.zeros_like(W)
    ret_bases = torch.tensor([ret.data_ptr()], dtype=torch.int64, device=dev)
    grad = torch.zeros(1, numel, device=dev, dtype=torch.bfloat16)
    regions = torch.randn(N, numel, device=dev).to(torch.bfloat16)
    se_regions = torch.zeros(N, dtype=torch.int64, device=dev)  # every region is expert 0's (rank 0's slots)
    moved = N * numel * 2
    rows = []

    def row(kernel, align, ms, ok):
        rows.append({"kernel": kernel, "align": align, "ms": ms, "gb_per_s": moved / ms / 1e6, "ok": ok})

    t = timer(lambda: slots.copy_(W), args.runs, args.warmup)
    row("torch copy_", "-", t, True)
    for align in (16, 2):
        slots.zero_()

        def fetch():
            S._push_slots_kernel[grid](se, se, se, 0, 1, numel, ptrs, slots, bases, 0, N, N, numel,
                                       CHUNK=S.COPY_CHUNK, RELAY=False, ALIGN=align, num_warps=S.COPY_WARPS)
        fetch()
        row("_push_slots_kernel (fetch from the homes)", align, timer(fetch, args.runs, args.warmup),
            torch.equal(slots, W))
        slots.zero_()

        def fetch_async():
            epoch.add_(1)
            S._push_slots_async_kernel[(programs,)](
                se, count, se, ptrs, slots, bases, flags, flag_bases, flags.shape[1], epoch, 0, N, N, numel,
                flags.shape[1], 0, CHUNK=S.COPY_CHUNK, ALIGN=align, num_warps=S.COPY_WARPS)
        fetch_async()
        row("_push_slots_async_kernel (copy by copy, no waits)", align, timer(fetch_async, args.runs, args.warmup),
            torch.equal(slots, W))
        ret.zero_()

        def push():
            S._push_grads_kernel[grid](se, se, se, 0, 1, 1, numel, W, ret_bases, 0, N, N, numel,
                                       CHUNK=S.COPY_CHUNK, RELAY=False, ALIGN=align, num_warps=S.COPY_WARPS)
        push()
        # slot j of rank 0 returns to region 0 * N + j of its home (rank 0)
        row("_push_grads_kernel (gradient return)", align, timer(push, args.runs, args.warmup), torch.equal(ret, W))

        def reduce():
            S._reduce_grads_kernel[(1, triton.cdiv(numel, S.COPY_CHUNK))](
                se_regions, se_regions, se_regions, 1, 0, 1, 1, numel, regions, grad, 0, 1, N, N, numel,
                CHUNK=S.COPY_CHUNK, RELAY=False, SLOTS=False, ALIGN=align, num_warps=S.COPY_WARPS)
        grad.zero_()
        reduce()
        want = regions.float().sum(0, keepdim=True).to(torch.bfloat16)
        ok = torch.allclose(grad.float(), want.float(), rtol=1e-2, atol=1e-2)
        row("_reduce_grads_kernel (the homes' sum, bytes read)", align, timer(reduce, args.runs, args.warmup), ok)
    return rows


def report(args, rows: list[dict], info: dict) -> str:
    base = rows[0]["gb_per_s"]
    table = markdown_table(["kernel", "ALIGN (bytes)", "ms", "GB/s", "/ torch copy_", "result"],
                           [[r["kernel"], r["align"], f"{r['ms']:.3f}", f"{r['gb_per_s']:.0f}",
                             f"{r['gb_per_s'] / base:.2f}", "ok" if r["ok"] else "WRONG"] for r in rows])
    return "\n".join([
        "# Replica copy kernels on one GPU", "",
        f"- date: {info['date']}; commit: `{info['commit']}`; hardware: {info['hardware']}",
        f"- {args.slots} experts of fc1 (2 x {args.ffn} x {args.hidden} bf16, "
        f"{2 * args.ffn * args.hidden * 2 / 2**20:.1f} MiB each) per call, HBM to HBM on one GPU; median of "
        f"{args.runs} runs; GB/s: bytes written (the sum: its regions' bytes read)",
        f"- reproduce: `{command('copy_kernels.py', args.argv)}`",
        "", table, ""])


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/copy_kernels.py times GPU kernels: run it on a machine with CUDA "
                         "(tools/gpu_session.sh copy_kernels)")
    rows = measure(args, torch.device("cuda", torch.cuda.current_device()))
    info = run_info({k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()})
    text = report(args, rows, info)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.md").write_text(text)
    write_json(args.out / f"{args.name}.json", info, rows)
    print(text)
    if not all(r["ok"] for r in rows):
        raise SystemExit("a copy kernel's result differs from torch's (see the table)")


if __name__ == "__main__":
    main()
