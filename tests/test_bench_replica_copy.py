"""bench/replica_copy.py on the CPU: its settings are checked with the fix named (the transfers need GPUs)."""

import pytest

from bench import replica_copy


def test_settings_are_checked():
    args = replica_copy.parse_args(["--slots", "4", "--chunks", "8192", "--warps", "8"])
    assert (args.slots, args.chunks, args.warps) == (4, [8192], [8])
    assert args.command == "bench/replica_copy.py --slots 4 --chunks 8192 --warps 8"
    with pytest.raises(ValueError, match="--chunks must be powers of two"):
        replica_copy.parse_args(["--chunks", "1000"])
    with pytest.raises(ValueError, match="--warps must be among"):
        replica_copy.parse_args(["--warps", "3"])
    with pytest.raises(ValueError, match="--slots must be in"):
        replica_copy.parse_args(["--slots", "65"])


def test_without_a_gpu_it_says_so():
    if __import__("torch").cuda.is_available():
        pytest.skip("has a GPU")
    with pytest.raises(SystemExit, match="needs GPUs"):
        replica_copy.main(["--slots", "2"])
