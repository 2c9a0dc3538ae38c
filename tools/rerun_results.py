"""Rerun the scripts behind results/ reports: each report's `reproduce:` command, one after the other.

    python tools/rerun_results.py link_sweep link_bound          # every results/<name>.md starting with these
    python tools/rerun_results.py --list link_sweep               # print the commands only
    python tools/rerun_results.py link_sweep --exclude link_sweep_large
    python tools/rerun_results.py --exact link_sweep_oracle link_sweep    # these reports, in this order

After a change to a planner or to the simulator, the CPU reports it feeds (the link sweeps, the bound, plan quality)
are stale: this reruns them exactly as they were written (their `- reproduce:` line names the command and every
option). A report that runs on a GPU (its `runs on` in tools/results_index.py's REPORTS) or whose command does not
start with `python` (torchrun) is left out and listed with the reason: run those on the GPU machine
(tools/gpu_session.sh). Prints a table of each command's time and exit status; exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "results"
_REPRODUCE = re.compile(r"^- reproduce: `([^`]+)`", re.M)


def runs_on(report: Path) -> str:
    """What a report runs on by tools/results_index.py's REPORTS ("CPU", "1 GPU", ...); "" where it is not listed."""
    sys.path.insert(0, str(REPO / "tools"))
    try:
        from results_index import REPORTS
    finally:
        sys.path.pop(0)
    return next((e.where for e in REPORTS if f"{report.stem}.md" in e.files), "")


def reproduce_command(report: Path) -> list[str]:
    """The argv of a report's `- reproduce:` command, with this interpreter for `python`; ValueError (naming why) if
    it has none, runs on a GPU or is not a python command."""
    where = runs_on(report)
    if where and not where.startswith("CPU"):
        raise ValueError(f"{report.name} runs on {where}: run it on the GPU machine (tools/gpu_session.sh)")
    m = _REPRODUCE.search(report.read_text())
    if m is None:
        raise ValueError(f"{report.name} has no '- reproduce: `...`' line")
    argv = shlex.split(m.group(1))
    if argv[0] != "python":
        raise ValueError(f"{report.name}: {m.group(1)!r} is not a python command (a GPU run: tools/gpu_session.sh)")
    return [sys.executable, *argv[1:]]


def reports(prefixes: list[str], exclude: list[str], exact: bool = False) -> list[Path]:
    """results/*.md whose stem starts with one of `prefixes` and with none of `exclude`, in name order; with
    `exact`, the reports named, in the order given."""
    if exact:
        missing = [n for n in prefixes if not (RESULTS / f"{n}.md").is_file()]
        if missing:
            raise SystemExit(f"no report results/<name>.md for {', '.join(missing)}")
        return [RESULTS / f"{n}.md" for n in prefixes if n not in exclude]
    out = sorted(p for p in RESULTS.glob("*.md") if p.name != "README.md" and p.stem.startswith(tuple(prefixes))
                 and not p.stem.startswith(tuple(exclude)))
    if not out:
        raise SystemExit(f"no report in results/ starts with {', '.join(prefixes)}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prefixes", nargs="+", help="report names (results/<name>.md) starting with these")
    ap.add_argument("--exclude", nargs="*", default=[],
                    help="leave out the reports starting with these (with --exact: these whole names)")
    ap.add_argument("--exact", action="store_true", help="the names are whole report names, run in the order given")
    ap.add_argument("--list", action="store_true", help="print the commands, run nothing")
    args = ap.parse_args(argv)
    todo, left_out = [], []
    for p in reports(args.prefixes, args.exclude, args.exact):
        try:
            todo.append((p, reproduce_command(p)))
        except ValueError as err:
            left_out.append(str(err))
    for why in left_out:
        print(f"left out: {why}")
    if args.list:
        for p, cmd in todo:
            print(f"{p.stem}: {shlex.join(['python', *cmd[1:]])}")
        return 0
    from tqdm import tqdm

    rows = []
    for p, cmd in tqdm(todo, desc="reports", unit="report"):
        t0 = time.perf_counter()
        done = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        rows.append((p.stem, time.perf_counter() - t0, done.returncode))
        if done.returncode:
            tqdm.write(f"{p.stem} failed ({done.returncode}):\n{done.stdout[-3000:]}")
    print("| report | s | exit |\n|---|---|---|")
    for name, s, rc in rows:
        print(f"| {name} | {s:.0f} | {rc} |")
    return int(any(rc for _, _, rc in rows))


if __name__ == "__main__":
    sys.exit(main())
