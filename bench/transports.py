"""Backend cuda's transports side by side: one table from bench/moe_layer.py's reports of the same cases, run once
per transport (one transport per process: a2a and deepep allocate their buffers collectively at the first call).

    python bench/transports.py OUT_DIR                      # OUT_DIR/moe_layer_deepep_{deepep,a2a,peer}.json
    python bench/transports.py --reports a.json b.json ...  # any reports of moe_layer.py, one per transport

`tools/gpu_session.sh deepep` runs the three reports on 2+ GPUs and then this script. Each row is one case (tokens,
routing, layer); per transport its median forward + backward (ms), its dispatch/combine phase (ms) and its ratio to
the peer transport's time in the same case (the same machine and session). Cases missing from a report are shown
as "-". Writes results/<name>.{md,json} (default name moe_layer_deepep).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ORDER = ("deepep", "a2a", "peer")


def load(paths: list[Path]) -> dict:
    """{transport: report}: each report's transport read from its config; two reports of one transport raise."""
    reports = {}
    for p in paths:
        report = json.loads(Path(p).read_text())
        tr = report["config"]["transport"]
        if tr in reports:
            raise ValueError(f"{p}: a second report of transport {tr!r}; pass one report per transport")
        reports[tr] = report
    return reports


def _key(row: dict) -> tuple:
    return row["tokens"], row["workload"], row["layout"], row["layer"]


def side_by_side(reports: dict) -> list[dict]:
    """One row per case of any report, in the first report's order: per transport ms, dispatch/combine ms and the
    ratio to peer (None where a report lacks the case or peer is missing)."""
    transports = [t for t in ORDER if t in reports] + sorted(t for t in reports if t not in ORDER)
    by = {t: {_key(r): r for r in reports[t]["rows"] if r.get("ran", True)} for t in transports}
    keys = []
    for t in transports:
        keys += [k for k in by[t] if k not in keys]
    rows = []
    for k in keys:
        peer = by.get("peer", {}).get(k)
        row = dict(zip(("tokens", "workload", "layout", "layer"), k))
        for t in transports:
            r = by[t].get(k)
            row[f"{t}_ms"] = r["ms"] if r else None
            row[f"{t}_dispatch_combine_ms"] = r.get("dispatch_combine_ms") if r else None
            row[f"{t}_vs_peer"] = r["ms"] / peer["ms"] if r and peer else None
        rows.append(row)
    return rows


def _f(v, fmt="{:.2f}"):
    return "-" if v is None else fmt.format(v)


def markdown(reports: dict, rows: list[dict]) -> str:
    transports = [t for t in ORDER if t in reports] + sorted(t for t in reports if t not in ORDER)
    first = reports[transports[0]]
    lines = ["# One MoE layer on backend cuda's transports", "",
             f"- hardware: {first.get('hardware', '?')}",
             "- reports: " + "; ".join(f"{t}: commit `{reports[t].get('commit', '?')}`, {reports[t].get('date', '?')}, "
                                       f"`{reports[t]['config'].get('command', '?')}`" for t in transports),
             "- ms: median forward + backward (bench/moe_layer.py); d/c: its dispatch/combine phase (serialised "
             "timer runs); / peer: the time over the peer transport's in the same case", "",
             "| tokens | routing | layout | layer | " + " | ".join(
                 f"{t} ms | {t} d/c ms" + ("" if t == "peer" else f" | {t} / peer") for t in transports) + " |",
             "|" + "---|" * (4 + sum(2 if t == "peer" else 3 for t in transports))]
    for r in rows:
        cells = [str(r["tokens"]), r["workload"], r["layout"], r["layer"]]
        for t in transports:
            cells += [_f(r[f"{t}_ms"]), _f(r[f"{t}_dispatch_combine_ms"])]
            if t != "peer":
                cells.append(_f(r[f"{t}_vs_peer"], "{:.2f}x"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", nargs="?", help="a folder with moe_layer_deepep_{deepep,a2a,peer}.json")
    ap.add_argument("--reports", nargs="+", type=Path, help="moe_layer.py reports, one per transport")
    ap.add_argument("--name", default="moe_layer_deepep", help="results/<name>.{md,json}")
    ap.add_argument("--results", type=Path, default=REPO / "results", help="where the table goes")
    args = ap.parse_args(argv)
    if bool(args.out_dir) == bool(args.reports):
        ap.error("give OUT_DIR or --reports, not both")
    paths = args.reports or [Path(args.out_dir) / f"moe_layer_deepep_{t}.json" for t in ORDER]
    missing = [str(p) for p in paths if not Path(p).exists()]
    if missing:
        print(f"transports.py: no report at {', '.join(missing)} (bench/moe_layer.py --name moe_layer_deepep_<transport> "
              "--transport <transport> writes it)", file=sys.stderr)
        return 1
    reports = load(paths)
    rows = side_by_side(reports)
    args.results.mkdir(parents=True, exist_ok=True)
    md = markdown(reports, rows)
    (args.results / f"{args.name}.md").write_text(md)
    (args.results / f"{args.name}.json").write_text(json.dumps(
        {"reports": {t: {k: reports[t].get(k) for k in ("date", "commit", "hardware", "config")} for t in reports},
         "rows": rows}, indent=1))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
