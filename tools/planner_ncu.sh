#!/usr/bin/env bash
# Where the CUDA planner kernel's warps stall, per CUDA source line (Nsight Compute's PC sampling), for one
# plan (a cooperative kernel: most samples are warps waiting at a barrier for the phase's busy warps):
# bash tools/planner_ncu.sh [policy] [EP] [E]   (defaults: topoep_plus 128 640; 8 ranks per domain; the spread
# policies profile csrc/spread.cu's one-block kernel,
# 2 slots, the bench/planner_latency.py workload). Writes $OUT (or results/gpu/ncu) planner.ncu-rep, the
# per-line CSV and planner_ncu_top.txt (the 40 source lines with the most stall samples, tools/ncu_top_lines.py). Needs ncu and the
# GPU's performance counters.
set -euo pipefail
POLICY=${1:-topoep_plus}; EP=${2:-128}; E=${3:-640}
OUT=${OUT:-results/gpu/ncu}
mkdir -p "$OUT"
cat > "$OUT/plan_once.py" <<PY
import sys
sys.path.insert(0, "$(pwd)")  # the repository (bench/)
import torch
from bench.planner_latency import workload
from topoep import solve
topo, omega = workload($EP, $E)
omega = omega.cuda()
for _ in range(4):  # the first three are skipped by ncu (--launch-skip 3)
    solve(omega, topo, num_slots=2, policy="$POLICY", backend="cuda")
torch.cuda.synchronize()
PY
KERNEL=topoep_kernel
case "$POLICY" in topoep_plus_spread*) KERNEL=spread_kernel ;; esac
ncu --kernel-name regex:$KERNEL --launch-skip 3 --launch-count 1 --import-source yes \
    --section SourceCounters --section WarpStateStats --section LaunchStats --section SpeedOfLight \
    -f -o "$OUT/planner" python3 "$OUT/plan_once.py" > "$OUT/ncu_run.log" 2>&1 || { tail -20 "$OUT/ncu_run.log"; exit 1; }
ncu -i "$OUT/planner.ncu-rep" --page details > "$OUT/planner_details.txt"
ncu -i "$OUT/planner.ncu-rep" --page source --print-source cuda,sass --csv > "$OUT/planner_source.csv"
python3 tools/ncu_top_lines.py "$OUT/planner_source.csv" 40 | tee "$OUT/planner_ncu_top.txt"
grep -E "Duration|Elapsed Cycles|SM Frequency|Registers|Block Limit" "$OUT/planner_details.txt" | head -12
