"""tools/ncu_top_lines.py on a small export in Nsight Compute's `--page source --print-source cuda,sass --csv` form."""

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

from ncu_top_lines import top_lines  # noqa: E402

EXPORT = '''"File Path","/usr/include/sync.h"
"Function Name","void k(int)"
"Line No","Source","Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)"
"109","__barrier_sync(0);","-","-","1,200","900"
"","","0x10","      BAR.SYNC.DEFER_BLOCKING 0x0","1200","900"
"File Path","/repo/csrc/planner.cu"
"Function Name","void k(int)"
"Line No","Source","Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)"
"7","// a comment","-","-","-","-"
"991","  m = part[0];","-","-","300","10"
"","","0x20","      LDS.64 R2, [UR4]","300","10"
"992","  for (...)","-","-","300","5"
'''


def test_top_lines_sums_per_source_line_and_orders_ties_by_file_and_line(tmp_path):
    path = tmp_path / "export.csv"
    path.write_text(EXPORT)
    rows = top_lines(str(path), 3)
    assert [(s, f, line) for s, f, line, _ in rows] == [(1200, "sync.h", 109), (300, "planner.cu", 991),
                                                        (300, "planner.cu", 992)]
    assert rows[1][3] == "m = part[0];"
    out = subprocess.run([sys.executable, "tools/ncu_top_lines.py", str(path), "2"], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parent.parent).stdout
    assert out.splitlines()[0] == "1800 stall samples; the 2 lines with the most:"
    assert "66.7%  sync.h:109" in out.splitlines()[1]


def test_top_lines_names_an_export_without_stall_samples(tmp_path):
    path = tmp_path / "export.csv"
    path.write_text('"File Path","/a.cu"\n"1","x"\n')
    try:
        top_lines(str(path))
    except SystemExit as e:
        assert "--print-source cuda,sass" in str(e)
    else:
        raise AssertionError("no error for an export without the stall columns")
