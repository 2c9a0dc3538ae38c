"""Compute and store the digests of the reference plans that the CUDA planner's GPU test compares with
(tests/planner_cases.py explains the file). Run it on any CPU machine after a change to the reference planner
or to the cases; the GPU test then needs no reference solves of its own.

    python tools/planner_ref_digests.py [--workers N]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import planner_cases as pc  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    if args.workers < 1:
        ap.error(f"--workers must be >= 1, got {args.workers}")
    key = pc.sources_key()
    chunks = {}
    with ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        for chunk in pc.CHUNK_NAMES:
            cases = list(enumerate(pc.cases_of(chunk, args.workers)))
            batches = [cases[i:i + 10] for i in range(0, len(cases), 10)]
            out = []
            for res in tqdm(pool.map(pc.reference_digests_batch, batches), total=len(batches),
                            desc=f"chunk {chunk} (batches of 10 cases)"):
                out.extend(res)
            chunks[str(chunk)] = out
    pc.DIGESTS.parent.mkdir(parents=True, exist_ok=True)
    pc.DIGESTS.write_text(json.dumps({"key": key, "chunks": chunks}, separators=(",", ":")) + "\n")
    print(f"wrote {pc.DIGESTS} ({pc.DIGESTS.stat().st_size / 1e3:.0f} kB, key {key[:12]})")


if __name__ == "__main__":
    main()
