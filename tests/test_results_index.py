"""results/ and its index (CPU unit tests): every results file has a producer in tools/results_index.py's tables,
every producer exists, and the committed results/README.md and results/paper_eval.md are what their scripts write
from the committed files."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import results_index as ri  # noqa: E402


def test_every_results_file_is_in_the_index_once():
    names = ri.listed()
    assert names, "results/ is empty"
    assert ri.unmatched() == [], "add these to tools/results_index.py's tables"
    for name in names:
        owners = [e.files for e in ri.REPORTS + ri.GPU if ri.matches(e, [name])]
        assert len(owners) == 1, f"{name} is in {len(owners)} entries: {owners}"


def test_every_entry_has_files_and_an_existing_script():
    names = ri.listed()
    for entry in ri.REPORTS + ri.GPU:
        assert ri.matches(entry, names), f"no file under results/ matches {entry.files}: remove the entry"
        assert (ri.REPO / entry.script).is_file(), f"{entry.files}: script {entry.script} does not exist"
        assert entry.command, f"{entry.files}: no command"


def test_top_level_files_are_reports_and_gpu_holds_records():
    assert all("/" not in pat for e in ri.REPORTS for pat in e.files)
    assert all(pat.startswith("gpu/") for e in ri.GPU for pat in e.files)


def test_committed_index_is_the_scripts_output():
    assert (ri.RESULTS / "README.md").read_text() == ri.render(), "run python tools/results_index.py"


def test_committed_paper_eval_summary_is_the_scripts_output():
    from bench import paper_eval_summary

    assert (ri.RESULTS / "paper_eval.md").read_text() == paper_eval_summary.summary(ri.RESULTS), \
        "run python bench/paper_eval_summary.py"
