"""bench/common.py's provenance line and tools/rerun_results.py's reading of a report's command."""

import subprocess
import sys
from pathlib import Path

import pytest

from bench.common import git_commit


def _git(repo, *args):
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


def test_git_commit_is_dirty_for_code_not_for_reports(tmp_path, monkeypatch):
    """A changed tracked file marks the commit dirty unless it lies in results/ (a report an earlier rerun
    rewrote); TOPOEP_COMMIT overrides the whole answer."""
    monkeypatch.delenv("TOPOEP_COMMIT", raising=False)
    _git(tmp_path, "init", "-q")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "a.md").write_text("old\n")
    (tmp_path / "code.py").write_text("x = 1\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    sha = git_commit(tmp_path)
    assert len(sha) == 12 and not sha.endswith("-dirty")
    (tmp_path / "results" / "a.md").write_text("new\n")
    assert git_commit(tmp_path) == sha
    (tmp_path / "code.py").write_text("x = 2\n")
    assert git_commit(tmp_path) == sha + "-dirty"
    monkeypatch.setenv("TOPOEP_COMMIT", "abc1234")
    assert git_commit(tmp_path) == "abc1234"


def test_rerun_results_reads_the_reproduce_command(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    import rerun_results

    report = tmp_path / "x.md"
    report.write_text("# X\n\n- date: d\n- reproduce: `python bench/link_sweep.py --eps 16 --name x` (2 s here)\n")
    assert rerun_results.reproduce_command(report) == [sys.executable, "bench/link_sweep.py", "--eps", "16",
                                                       "--name", "x"]
    report.write_text("- reproduce: `torchrun --nproc_per_node=1 bench/layer_limit.py`\n")
    with pytest.raises(ValueError, match="not a python command"):
        rerun_results.reproduce_command(report)
    report.write_text("# nothing to run\n")
    with pytest.raises(ValueError, match="has no"):
        rerun_results.reproduce_command(report)
    assert "link_sweep" in {p.stem for p in rerun_results.reports(["link_sweep"], [])}
    assert not any(p.stem.startswith("link_sweep_oracle") for p in rerun_results.reports(["link_sweep"],
                                                                                            ["link_sweep_oracle"]))
    assert [p.stem for p in rerun_results.reports(["link_sweep_oracle", "link_sweep"], [], exact=True)] == [
        "link_sweep_oracle", "link_sweep"]
    with pytest.raises(SystemExit, match="no report"):
        rerun_results.reports(["no_such_report"], [], exact=True)


def test_topoep_commit_must_be_a_commit(monkeypatch):
    """TOPOEP_COMMIT names a commit (hex, '-dirty' allowed); anything else is refused with the value named."""
    for ok in ("abc1234", "0123456789abcdef0123456789abcdef01234567", "abc1234-dirty"):
        monkeypatch.setenv("TOPOEP_COMMIT", ok)
        assert git_commit() == ok
    for bad in ("64cc4b5-fast", "HEAD", "abc"):
        monkeypatch.setenv("TOPOEP_COMMIT", bad)
        with pytest.raises(SystemExit, match=f"TOPOEP_COMMIT='{bad}'"):
            git_commit()


def test_reproduce_command_is_the_runs_own_options():
    """bench.common.command: the options main() was given (not the process's command line), less --out and the
    options named; None: the process's command line."""
    from bench.common import command

    argv = ["--eps", "16", "--out", "/tmp/x", "--quiet", "--name", "n"]
    assert command("link_sweep.py", argv) == "python bench/link_sweep.py --eps 16 --quiet --name n"
    assert command("capacity.py", ["--quiet"], "--quiet") == "python bench/capacity.py"


def test_link_sweep_writes_the_options_it_was_given(tmp_path, monkeypatch):
    """A report written from main(argv) names argv in its reproduce line, whatever the process's command line."""
    from bench import link_sweep

    monkeypatch.setattr(sys, "argv", ["pytest"])
    link_sweep.main(["--presets", "h200", "--eps", "16", "--slots", "1", "--scenarios", "uniform", "--nic-scale", "0.5",
                     "--out", str(tmp_path), "--name", "x"])
    text = (tmp_path / "x.md").read_text()
    assert ("- reproduce: `python bench/link_sweep.py --presets h200 --eps 16 --slots 1 --scenarios uniform "
            "--nic-scale 0.5 --name x`") in text


def test_rerun_results_leaves_out_gpu_reports_and_reports_without_a_command(tmp_path, capsys):
    """GPU reports (by results_index's `runs on`) and reports without a reproduce line are left out with the reason,
    and the others still run (here: listed)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    import rerun_results

    with pytest.raises(ValueError, match="planner_latency.md runs on 1 GPU"):
        rerun_results.reproduce_command(rerun_results.RESULTS / "planner_latency.md")
    assert rerun_results.main(["--list", "--exact", "planner_latency", "capacity"]) == 0
    out = capsys.readouterr().out
    assert "left out: planner_latency.md runs on 1 GPU" in out and "capacity: python bench/capacity.py" in out
