"""Helper for the Triton kernels' CPU checks: run a check script of tests/ under Triton's interpreter."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def interpreted_cases(script: str) -> list[str]:
    """Run tests/<script> in a subprocess with TRITON_INTERPRET=1 (read when triton is imported, so it needs a
    fresh process) and no visible GPU (the interpreter alone, also on a GPU machine); assert it exits 0 and return
    its `case ...` lines."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(HERE / script)], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    return [ln for ln in out.stdout.splitlines() if ln.startswith("case ")]
