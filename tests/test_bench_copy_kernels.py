"""bench/copy_kernels.py on the CPU: its settings are checked, and without a GPU it says where to run it (the kernels
need CUDA; tools/gpu_session.sh copy_kernels)."""

import pytest
import torch

from bench import copy_kernels


def test_settings_are_checked():
    args = copy_kernels.parse_args(["--slots", "4", "--hidden", "64", "--ffn", "32", "--runs", "3"])
    assert (args.slots, args.hidden, args.ffn, args.runs) == (4, 64, 32, 3)
    with pytest.raises(SystemExit):
        copy_kernels.parse_args(["--slots", "0"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="has a GPU: the script runs instead")
def test_without_a_gpu_it_says_so():
    with pytest.raises(SystemExit, match="run it on a machine with CUDA"):
        copy_kernels.main(["--slots", "2"])


def test_every_kernel_call_is_right_in_the_interpreter():
    """measure()'s launches (the arguments it passes each kernel, ALIGN 16 and 2) run in Triton's interpreter on the
    CPU with small weights, and every result equals torch's (the rows' `ok`); each call times 1.0."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    code = (
        "import sys, torch; sys.path.insert(0, 'tests'); from test_symm_interpret import _patch_interpreter; "
        "_patch_interpreter(); from bench import copy_kernels as C; "
        "args = C.parse_args(['--slots', '3', '--hidden', '64', '--ffn', '96', '--runs', '1']); "
        "rows = C.measure(args, torch.device('cpu'), timer=lambda fn, runs, warmup: (fn(), 1.0)[1], programs=2); "
        "print(len(rows), all(r['ok'] for r in rows))")
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         env={**__import__("os").environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["9", "True"], out.stdout
