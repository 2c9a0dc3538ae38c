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
