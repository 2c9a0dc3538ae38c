"""The CUDA source lines with the most warp stall samples in an Nsight Compute source export
(`ncu -i REP --page source --print-source cuda,sass --csv`): python tools/ncu_top_lines.py CSV [N]."""

from __future__ import annotations

import csv
import sys


def top_lines(path: str, n: int | None = 40) -> list[tuple[int, str, int, str]]:
    """[(samples, file name, line, source text)] of the n lines (None: all) with the most "Warp Stall Sampling (All
    Samples)", most first. The export lists, per source file, a row per line with the line's totals, then its SASS
    rows."""
    data, name, col = [], "?", None
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "File Path":
                name = row[1].rsplit("/", 1)[-1]
            elif row[0] == "Line No":
                col = row.index("Warp Stall Sampling (All Samples)")
            elif col is not None and row[0].isdigit() and len(row) > col:
                v = row[col].replace(",", "")
                data.append((int(v) if v.isdigit() else 0, name, int(row[0]), row[1].strip()))  # "-": no SASS
    if col is None:
        raise SystemExit(f"{path}: no 'Line No' header with warp stall samples (export with --print-source cuda,sass)")
    return sorted(data, key=lambda d: (-d[0], d[1], d[2]))[:n]


def main() -> None:
    path, n = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40
    every = top_lines(path, None)
    rows = every[:n]
    total = sum(s for s, *_ in every) or 1
    print(f"{total} stall samples; the {len(rows)} lines with the most:")
    for s, name, line, text in rows:
        print(f"{100 * s / total:5.1f}%  {name}:{line}  {text[:110]}")


if __name__ == "__main__":
    main()
