"""Helpers shared by the benchmark scripts: run provenance and result files."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import statistics
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def git_commit(repo: Path = REPO) -> str:
    """The checkout's commit, with "-dirty" where a tracked file outside results/ differs from it (reports rewritten
    by an earlier run, as tools/rerun_results.py leaves them, change nothing that makes the next one); TOPOEP_COMMIT
    overrides it where the copy's git metadata is stale (the device machine gets a copy of the working tree whose
    .git may lag behind)."""
    if os.environ.get("TOPOEP_COMMIT"):
        given = os.environ["TOPOEP_COMMIT"]
        if not re.fullmatch(r"[0-9a-f]{7,40}(-dirty)?", given):
            raise SystemExit(f"TOPOEP_COMMIT={given!r}: a commit hash (7-40 hex digits), '-dirty' appended where "
                             "the working tree differs from it; unset it to read the checkout's")
        return given
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=repo, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)results"], cwd=repo, capture_output=True, text=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def hardware() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    desc = f"{cpu}, {os.cpu_count()} CPUs, torch {torch.__version__} ({torch.get_num_threads()} threads)"
    if torch.cuda.is_available():
        desc += f", {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return desc


def run_info(config: dict) -> dict:
    """Provenance of a result: date, commit, hardware and the configuration (without output paths, which
    are this machine's, not the result's, nor `argv`, the command line the report's reproduce line gives)."""
    config = {k: v for k, v in config.items() if k not in ("out", "argv")}
    return {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "commit": git_commit(),
            "hardware": hardware(), "config": config}


def without_options(argv: list[str], *names: str) -> list[str]:
    """argv without each option in names and its value (e.g. output folders, which are this machine's and
    not part of a result's reproduce command)."""
    out = list(argv)
    for name in names:
        if name in out:
            i = out.index(name)
            del out[i:i + 2]
    return out


def repo_relative(path: Path) -> str:
    """`path` relative to the repository where it lies inside it (a reproduce line names committed files)."""
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def parse_options(parser, argv: list[str] | None):
    """parser.parse_args(argv), with the options themselves kept as args.argv (None: the process's command line) for
    the report's reproduce line (`command`)."""
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    return args


def command(script: str, argv: list[str] | None, *drop: str) -> str:
    """A report's reproduce command: `python bench/<script>` with the options this run was given (`argv`, what
    main() parsed; None: the process's command line), less --out and `drop` (options that only say where a run
    writes or how it prints, not what it measures)."""
    argv = sys.argv[1:] if argv is None else argv
    return " ".join(["python", f"bench/{script}", *without_options(list(argv), "--out", *drop)])


def markdown_table(header: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def write_json(path: Path, info: dict, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**info, "rows": rows}, indent=1) + "\n")


def write_report(args, text: str, rows: list[dict]) -> None:
    """args.out / args.name + ".md" (the report) and ".json" (run_info of args' options, and the rows)."""
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.md").write_text(text)
    info = run_info({k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()})
    (args.out / f"{args.name}.json").write_text(json.dumps({**info, "rows": rows}, indent=1))


def bench_gpu() -> torch.device:
    """A benchmark rank's GPU (LOCAL_RANK under torchrun), one per process: GPUs are never shared by benchmark
    ranks, whose times would mean nothing (the GPU tests can share one for correctness: TOPOEP_GPU_SHARE=1)."""
    from topoep.runtime.backend import local_gpu

    dev = local_gpu(int(os.environ.get("LOCAL_RANK", 0)), f"torchrun --nproc_per_node={torch.cuda.device_count()}")
    torch.cuda.set_device(dev)
    return dev


def median_cuda_ms(fn, runs: int, warmup: int = 2) -> float:
    """Median ms of fn() on the current CUDA stream over `runs` calls (`cuda_ms`), after `warmup` calls."""
    for _ in range(warmup):
        fn()
    return statistics.median(cuda_ms(fn) for _ in range(runs))


def cuda_ms(fn) -> float:
    """ms of one call of fn() on the current CUDA stream: CUDA events around it, waited for."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)
