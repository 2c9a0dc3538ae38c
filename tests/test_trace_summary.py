"""tools/trace_summary.py on a synthetic Chrome trace: counts per call, barrier waits, the main stream's
wait for a side-stream branch, and its idle time."""

import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import trace_summary  # noqa: E402


def _k(name, ts, dur, stream):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_summary_and_diff(tmp_path):
    calls = 2
    ev = []
    for c in range(calls):
        t = 10_000 * c
        ev += [_k("gemm", t, 100, 7), _k("barrier_kernel", t + 100, 30, 7),
               _k("stats", t + 100, 200, 9),  # side branch ends at t + 300
               _k("dispatch", t + 302, 50, 7)]  # the main stream waited 300 - 130 = 170 us for it
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": t, "dur": 5})
    a = tmp_path / "a.json.gz"
    with gzip.open(a, "wt") as f:
        json.dump({"traceEvents": ev}, f)
    s = trace_summary.summary(a, calls)
    assert "4 GPU ops/call" in s and "busy 380 us/call" in s
    assert "1.0 barriers/call waiting 30 us/call" in s and "1 host runtime calls/call" in s
    assert "main stream waited 170 us" in s
    # main stream: from 0 to 10352 us, kernels of its own for 2 x 180 us of it
    assert "span 5176 us/call, idle 4996 us/call" in s
    b = tmp_path / "b.json"
    b.write_text(json.dumps({"traceEvents": ev + [_k("extra", 50_000, 40, 7)]}))
    d = trace_summary.diff(a, b, calls)
    assert "0.0 ->   0.5" in d and "extra" in d and "gemm" not in d
