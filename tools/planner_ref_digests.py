"""Compute and store the digests of the reference plans that the CUDA planner's GPU test compares with
(tests/planner_cases.py explains the file). Run it on any CPU machine after a change to the reference planner
or to the cases; the GPU test then needs no reference solves of its own.

    python tools/planner_ref_digests.py [--workers N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import planner_cases as pc  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    if args.workers < 1:
        ap.error(f"--workers must be >= 1, got {args.workers}")
    key = pc.sources_key()
    chunks = {str(chunk): pc.reference_digests_parallel(list(enumerate(pc.cases_of(chunk, args.workers))), args.workers,
                                                        desc=f"chunk {chunk} (batches of 10 cases)")
              for chunk in pc.CHUNK_NAMES}
    pc.DIGESTS.parent.mkdir(parents=True, exist_ok=True)
    pc.DIGESTS.write_text(json.dumps({"key": key, "chunks": chunks}, separators=(",", ":")) + "\n")
    print(f"wrote {pc.DIGESTS} ({pc.DIGESTS.stat().st_size / 1e3:.0f} kB, key {key[:12]})")


if __name__ == "__main__":
    main()
