"""Summarise Chrome traces of MoE-layer calls (bench/moe_layer.py --torch-profile --trace-dir DIR):
where the GPU time of a call goes and what waits for what.

    python tools/trace_summary.py TRACE [TRACE ...] [--calls 5] [--diff]

Per trace: GPU kernels per call, GPU busy time per call, symmetric-memory barrier kernels and the time they
spend waiting (a barrier kernel runs until the peer arrives, so its time is the ranks' skew), host runtime
calls per call, and every side-stream branch (kernels off the main stream, e.g. the plan statistics) with the
time the main stream sat idle waiting for it to finish. --diff: kernel counts and times per call that differ
between the first trace and each other one (e.g. static vs topoep on the same routing).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
from pathlib import Path

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def load(path: Path) -> list[dict]:
    """The trace's complete events ('X')."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def kernels(events: list[dict]) -> list[dict]:
    return sorted((e for e in events if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])


def main_stream(ks: list[dict]):
    """The stream with the most kernels (the layer's own)."""
    return collections.Counter(e["args"].get("stream") for e in ks).most_common(1)[0][0]


def side_branches(ks: list[dict], main, gap_us: float = 500.0) -> list[dict]:
    """Side-stream kernels clustered into branches (a gap of more than gap_us starts a new one), each with its
    span and how long the main stream was idle before the branch ended (the main stream's wait for it)."""
    side = [e for e in ks if e["args"].get("stream") != main]
    groups, cur = [], []
    for e in side:
        if cur and e["ts"] - (cur[-1]["ts"] + cur[-1]["dur"]) > gap_us:
            groups.append(cur)
            cur = []
        cur.append(e)
    if cur:
        groups.append(cur)
    out = []
    for g in groups:
        s0, s1 = g[0]["ts"], max(e["ts"] + e["dur"] for e in g)
        main_before = [e["ts"] + e["dur"] for e in ks if e["args"].get("stream") == main and s0 <= e["ts"] <= s1]
        nxt = [e["ts"] for e in ks if e["args"].get("stream") == main and e["ts"] > s1]
        waited = (s1 - max(main_before)) if main_before and nxt and nxt[0] - s1 < 10 else 0.0
        out.append(dict(kernels=len(g), span_us=s1 - s0, main_wait_us=max(0.0, waited)))
    return out


def summary(path: Path, calls: int) -> str:
    ev = load(path)
    ks = kernels(ev)
    main = main_stream(ks)
    busy = sum(e["dur"] for e in ks)
    bar = [e for e in ks if "barrier" in e["name"]]
    runtime = [e for e in ev if e.get("cat") == "cuda_runtime"]
    br = side_branches(ks, main)
    span, idle = main_idle(ks, main)
    lines = [f"{path.name}: {len(ks) / calls:.0f} GPU ops/call, busy {busy / calls:.0f} us/call, "
             f"main stream: span {span / calls:.0f} us/call, idle {idle / calls:.0f} us/call (no kernel of its own "
             "running: waiting for the host, a peer or a side stream), "
             f"{len(bar) / calls:.1f} barriers/call waiting {sum(e['dur'] for e in bar) / calls:.0f} us/call, "
             f"{len(runtime) / calls:.0f} host runtime calls/call"]
    if br:
        n = len(br)
        lines.append(f"  side-stream branches: {n} ({n / calls:.1f}/call), mean {sum(b['kernels'] for b in br) / n:.0f} "
                     f"kernels over {sum(b['span_us'] for b in br) / n:.0f} us; the main stream waited "
                     f"{sum(b['main_wait_us'] for b in br) / n:.0f} us for each")
    return "\n".join(lines)


def main_idle(ks: list[dict], main) -> tuple[float, float]:
    """(span from the main stream's first kernel start to its last kernel end, the part of it in which no kernel
    of the main stream ran), us."""
    m = [e for e in ks if e["args"].get("stream") == main]
    if not m:
        return 0.0, 0.0
    start, covered, end = m[0]["ts"], 0.0, m[0]["ts"]
    for e in m:  # sorted by start: the union of the intervals
        s, t = e["ts"], e["ts"] + e["dur"]
        if t > end:
            covered += t - max(s, end)
            end = t
    return end - start, end - start - covered


def _short(name: str) -> str:
    return name.split("(")[0].replace("void ", "")[:90]


def diff(a: Path, b: Path, calls: int, rows: int = 25) -> str:
    """Per-call kernel counts and times that differ between traces a and b."""
    tables = []
    for p in (a, b):
        ks = kernels(load(p))
        n, t = collections.Counter(), collections.Counter()
        for e in ks:
            n[_short(e["name"])] += 1
            t[_short(e["name"])] += e["dur"]
        tables.append((n, t))
    (na, ta), (nb, tb) = tables
    keys = sorted(set(na) | set(nb), key=lambda k: -abs(tb[k] - ta[k]))
    out = [f"{a.name} -> {b.name} (per call: count, us)"]
    for k in keys[:rows]:
        if na[k] != nb[k] or abs(tb[k] - ta[k]) > 5 * calls:
            out.append(f"  {na[k] / calls:5.1f} -> {nb[k] / calls:5.1f}   {ta[k] / calls:8.1f} -> {tb[k] / calls:8.1f}  {k}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--calls", type=int, default=5, help="layer calls in each trace (bench/moe_layer.py: 5)")
    ap.add_argument("--diff", action="store_true", help="kernels that differ from the first trace")
    args = ap.parse_args(argv)
    if args.calls < 1:
        raise SystemExit(f"--calls must be >= 1, got {args.calls}")
    for p in args.traces:
        print(summary(p, args.calls))
    if args.diff:
        for p in args.traces[1:]:
            print(diff(args.traces[0], p, args.calls))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
