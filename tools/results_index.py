"""Writes results/README.md: an index of every file under results/ and what makes it.

    python tools/results_index.py           # rewrite results/README.md
    python tools/results_index.py --check   # exit 1 if a results file is not in the table below, or the index is stale

Top-level files are reports: a script in bench/ or tools/ writes each of them, and running its command again makes
it anew (on the hardware named). results/gpu/ keeps the records of GPU runs (logs, raw JSON, the notes written with
them); rerunning the step makes new records, it does not rewrite these. The tables below say, for every file,
which script writes it, what it reads and the command; tests/test_results_index.py checks that they cover
results/ and that the committed index is this script's output.
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "results"


@dataclass(frozen=True)
class Entry:
    files: tuple[str, ...]  # glob patterns relative to results/; a folder of results/gpu/ stands for all it holds
    script: str  # the script that writes them, relative to the repository root
    reads: str  # the raw data it reads ("-": it generates its inputs)
    where: str  # what it runs on
    command: str
    what: str = ""  # a description: after a report's first heading; in place of a gpu/ record's heading


GPU_SESSION = "tools/gpu_session.sh"
PAPER_EVAL_RUNS = "train.py runs in runs/eval (not committed; the .json keeps each run's summary)"


def _layer(name: str, what: str, args: str, gpus: int = 2) -> Entry:
    return Entry((f"{name}.md", f"{name}.json", f"{name}_breakdown.png"), "bench/moe_layer.py",
                 "its own measurement (the .json: every case)", f"{gpus} GPU" + ("s" if gpus > 1 else ""),
                 f"torchrun --nproc_per_node={gpus} bench/moe_layer.py {args}", what)


def _sweep(name: str, args: str) -> Entry:
    """A variant of bench/link_sweep.py's report: its options `args`, written as <name>.md and .json."""
    return Entry((f"{name}.md", f"{name}.json"), "bench/link_sweep.py", "-", "CPU",
                 f"python bench/link_sweep.py {args} --name {name}")


def _fig(name: str, what: str, args: str, where: str = "2 GPUs") -> Entry:
    return Entry((f"{name}.md", f"{name}.json", f"{name}.png"), "bench/paper_eval.py", PAPER_EVAL_RUNS, where,
                 f"python bench/paper_eval.py {args}", what)


REPORTS = [
    Entry(("README.md",), "tools/results_index.py", "its tables, the reports' first headings", "CPU",
          "python tools/results_index.py"),
    Entry(("plan_quality.md", "plan_quality.json", "plan_quality*.png"), "bench/plan_quality.py",
          "- (workloads generated; t_ffn fitted on moe_layer.json, reported only)", "CPU",
          "make plan-quality"),
    Entry(("capacity.md", "capacity.json"), "bench/capacity.py", "-", "CPU", "python bench/capacity.py"),
    Entry(("link_bound.md", "link_bound.json"), "bench/link_bound.py", "- (scenarios generated)", "CPU",
          "python bench/link_bound.py"),
    Entry(("link_sweep.md", "link_sweep.json"), "bench/link_sweep.py", "- (scenarios generated; the simulator's presets)",
          "CPU", "python bench/link_sweep.py"),
    _sweep("link_sweep_nic0.5", "--presets paper_h800 --nic-scale 0.5"),
    _sweep("link_sweep_nic2", "--presets paper_h800 --nic-scale 2"),
    _sweep("link_sweep_large", "--eps 128 256 --slots 2"),
    _sweep("link_sweep_share", "--relay-share"),
    _sweep("link_sweep_relay_chunks2", "--relay-chunks 2"),
    _sweep("link_sweep_relay_chunks4", "--relay-chunks 4"),
    _sweep("link_sweep_relay_chunks4_share", "--relay-chunks 4 --relay-share"),
    _sweep("link_sweep_overlap", "--fetch-overlap"),
    _sweep("link_sweep_overlap_nic0.5", "--presets paper_h800 --nic-scale 0.5 --fetch-overlap"),
    _sweep("link_sweep_overlap_nic2", "--presets paper_h800 --nic-scale 2 --fetch-overlap"),
    _sweep("link_sweep_spread_measured", "--spread-planner measured"),
    _sweep("link_sweep_spread_measured_x10", "--spread-planner measured --spread-speedup 10"),
    _sweep("link_sweep_spread_measured_x30", "--spread-planner measured --spread-speedup 30"),
    _sweep("link_sweep_spread_measured_nogate", "--spread-planner measured --spread-gate off"),
    _sweep("link_sweep_peers", "--peer-candidates"),
    _sweep("link_sweep_peers_measured", "--peer-candidates --peer-planner measured"),
    _sweep("link_sweep_guard_pipeline", "--guard-pipeline --spread-planner measured"),
    _sweep("link_sweep_oracle", "--spread-planner measured --oracle"),
    _sweep("link_sweep_oracle_overlap_share", "--fetch-overlap --relay-share --spread-planner measured --oracle"),
    _sweep("link_sweep_oracle_overlap_share_f3",
           "--fetch-overlap --relay-share --relay-fanout 3 --spread-planner measured --oracle"),
    _sweep("link_sweep_oracle_overlap_share_async",
           "--fetch-overlap --relay-share --spread-planner measured --oracle --relay-schedule async"),
    _sweep("link_sweep_oracle_overlap_share_async_peers_gpu",
           "--fetch-overlap --relay-share --spread-planner measured --oracle --relay-schedule async --peers-on-gpu"),
    _sweep("link_sweep_oracle_overlap_share_async_peer_relays",
           "--fetch-overlap --relay-share --spread-planner measured --oracle --relay-schedule async --peer-relays"),
    _sweep("link_sweep_oracle_overlap_share_async_nic0.5", "--presets paper_h800 --nic-scale 0.5 --fetch-overlap "
           "--relay-share --spread-planner measured --oracle --relay-schedule async"),
    _sweep("link_sweep_oracle_overlap_share_async_nic2", "--presets paper_h800 --nic-scale 2 --fetch-overlap "
           "--relay-share --spread-planner measured --oracle --relay-schedule async"),
    _sweep("link_sweep_oracle_overlap_share_async_gp", "--guard-pipeline --fetch-overlap --relay-share "
           "--spread-planner measured --oracle --relay-schedule async"),
    _sweep("link_sweep_oracle_overlap_share_async_gp_nic0.5", "--guard-pipeline --presets paper_h800 --nic-scale 0.5 "
           "--fetch-overlap --relay-share --spread-planner measured --oracle --relay-schedule async"),
    _sweep("link_sweep_oracle_overlap_share_async_gp_nic2", "--guard-pipeline --presets paper_h800 --nic-scale 2 "
           "--fetch-overlap --relay-share --spread-planner measured --oracle --relay-schedule async"),
    _sweep("link_sweep_overlap_share_measured", "--fetch-overlap --relay-share --spread-planner measured"),
    _sweep("link_sweep_cuda", "--execution cuda"),
    _sweep("link_sweep_cuda_serial_guard", "--execution cuda --token-overlap 0"),
    _sweep("link_sweep_guard_pipeline_overlap_share",
           "--guard-pipeline --fetch-overlap --relay-share --spread-planner measured"),
    Entry(("plan_domain.md", "plan_domain.json"), "bench/plan_domain.py",
          "- (scenarios generated; the simulator's presets)", "CPU", "python bench/plan_domain.py"),
    Entry(("replacement.md", "replacement.json"), "bench/replacement.py",
          "- (scenarios generated; the simulator's presets)", "CPU", "python bench/replacement.py"),
    Entry(("joint_work.md", "joint_work.json"), "bench/joint_work.py", "-", "CPU", "python bench/joint_work.py"),
    Entry(("simulation.md", "simulation.json", "simulation_*.png"), "bench/simulate.py",
          "moe_layer.json, moe_layer_slots8.json (calibration and hold-out)", "CPU", "python bench/simulate.py"),
    Entry(("guard_latency.md", "guard_latency.json"), "bench/guard_latency.py", "-", "1 GPU",
          "bash tools/gpu_session.sh setup guard"),
    Entry(("layer_limit.md", "layer_limit.json"), "bench/layer_limit.py", "its own measurement", "1 GPU",
          "bash tools/gpu_session.sh setup local (or: torchrun --nproc_per_node=1 bench/layer_limit.py)"),
    Entry(("planner_latency.md", "planner_latency.json"), "bench/planner_latency.py", "its own measurement", "1 GPU",
          "python bench/planner_latency.py --profile"),
    Entry(("spread_latency.md", "spread_latency.json"), "bench/planner_latency.py", "its own measurement", "1 GPU",
          "python bench/planner_latency.py --spread"),
    Entry(("peer_latency.md", "peer_latency.json"), "bench/planner_latency.py", "its own measurement", "1 GPU",
          "python bench/planner_latency.py --peers (bash tools/gpu_session.sh setup peers)"),
    Entry(("layer_memory.md", "layer_memory.json"), "bench/layer_memory.py", "gpu/layer_memory/layer_memory_ep*.json",
          "CPU, from the raw runs (they: 1 GPU, `bash tools/gpu_session.sh setup memory`)",
          "python bench/layer_memory.py --report results/gpu/layer_memory/layer_memory_ep*.json"),
    _layer("moe_layer", "backends torch and cuda beside megatron's layer, 2 slots", "--tokens 4096 16384"),
    _layer("moe_layer_slots8", "backend cuda, 8 slots; bench/simulate.py's hold-out",
           "--name moe_layer_slots8 --tokens 4096 16384 --backends cuda --no-megatron --slots 8"),
    _layer("moe_layer_cuda", "backend cuda, 2 slots",
           "--name moe_layer_cuda --backends cuda --no-megatron --slots 2 --tokens 4096 16384"),
    _layer("moe_layer_cuda_slots8", "backend cuda, 8 slots",
           "--name moe_layer_cuda_slots8 --backends cuda --no-megatron --slots 8 --tokens 4096 16384"),
    _layer("moe_layer_a2a", "backend cuda on transport a2a, 2 GPUs as 2 domains",
           "--name moe_layer_a2a --transport a2a --ranks-per-domain 1 --backends cuda --tokens 4096 --no-megatron"),
    _layer("moe_layer_capacity_ep1", "backend cuda at EP 1, the capacity against worst-case buffers",
           "--name moe_layer_capacity_ep1 --backends cuda --no-megatron --capacity-factors default none "
           "--tokens 4096 16384 --skews 0 -4 --layouts random --profile-iters 0", gpus=1),
    _layer("fig15", "Fig. 15: the phases in forward and backward",
           "--name fig15 --tokens 8192 --skews -4 --profile-iters 5"),
    _layer("fig16_layer", "backend torch at 1 rank per domain (Fig. 16's setting)",
           "--name fig16_layer --tokens 4096 --skews -4 --backends torch --ranks-per-domain 1 --no-megatron "
           "--profile-iters 5"),
    _fig("fig12", "Qwen3", "fig12 --steps 25 --warmup 5"),
    _fig("fig12_repeats", "Qwen3, 3 interleaved runs per configuration",
         "fig12 --name fig12_repeats --skews 0 -1 -4 --layouts megatron --policies static topoep --repeats 3 "
         "--steps 25 --warmup 5"),
    _fig("fig12_glm45air", "GLM-4.5-Air, 1 dense + 2 MoE layers",
         "fig12 --name fig12_glm45air --model glm45air --set model.num_layers=3 --skews natural 0 -2 -4 "
         "--steps 25 --warmup 5"),
    _fig("fig12_deepseekv2", "DeepSeek-V2, 1 dense + 2 MoE layers, sequence 2048",
         "fig12 --name fig12_deepseekv2 --model deepseekv2 --set model.num_layers=3 trainer.seq_length=2048 "
         "--skews natural 0 -2 -4 --steps 25 --warmup 5"),
    _fig("fig12_torch_balanced_rpd1", "backend torch, static, 2 domains of 1 rank",
         "fig12 --name fig12_torch_balanced_rpd1 --backend torch --ranks-per-domain 1 --policies static --skews -4 "
         "--layouts megatron --steps 20 --warmup 5"),
    _fig("fig12_torch_balanced_rpd2", "backend torch, static, 1 domain of 2 ranks",
         "fig12 --name fig12_torch_balanced_rpd2 --backend torch --ranks-per-domain 2 --policies static --skews -4 "
         "--layouts megatron --steps 20 --warmup 5"),
    _fig("fig13", "Qwen3", "fig13 --steps 25 --warmup 5"),
    _fig("fig14", "Qwen3, 300 steps", "fig14 --steps 25 --warmup 5"),
    _fig("fig16", "Qwen3, backend torch, 2 domains of 1 rank",
         "fig16 --steps 25 --warmup 5 --backend torch --ranks-per-domain 1 --policies static topoep deepseek "
         "fastermoe flexmoe"),
    _fig("fig16_repeats", "as fig16, 2 interleaved runs",
         "fig16 --name fig16_repeats --backend torch --ranks-per-domain 1 --policies static topoep --layouts megatron "
         "--repeats 2 --steps 25 --warmup 5"),
    _fig("fig16_cpu_2x2", "tiny model on the CPU, 2 domains of 2 ranks",
         "fig16 --tiny --nproc 4 --ranks-per-domain 2 --steps 12 --warmup 2 --name fig16_cpu_2x2",
         where="CPU (4 processes)"),
    Entry(("paper_eval.md",), "bench/paper_eval_summary.py",
          "fig12.json, fig12_repeats.json, fig12_glm45air.json, fig12_deepseekv2.json, fig13.json, fig14.json, "
          "fig16_cpu_2x2.json", "CPU", "python bench/paper_eval_summary.py"),
]

GPU = [
    Entry(("gpu/README.md",), GPU_SESSION, "-", "-", "-",
          "Notes on the GPU sessions, written with their logs: which step ran at which commit, and what it showed"),
    Entry(("gpu/capacity",), GPU_SESSION, "-", "1 GPU", "bash tools/gpu_session.sh setup capacity capacity_ep8"),
    Entry(("gpu/product_shape",), GPU_SESSION, "-", "1 GPU", "bash tools/gpu_session.sh setup planner shape"),
    Entry(("gpu/link_guard",), GPU_SESSION, "-", "1 GPU", "bash tools/gpu_session.sh setup planner shape"),
    Entry(("gpu/guard_batch",), GPU_SESSION, "-", "1 GPU", "bash tools/gpu_session.sh setup guard (and the commands "
          "in its README)"),
    Entry(("gpu/gate",), GPU_SESSION, "-", "1 GPU", "bash tools/gpu_session.sh setup gate (its README names each log's "
          "command)"),
    Entry(("gpu/peers",), GPU_SESSION, "-", "1 GPU", "bash tools/gpu_session.sh setup peers (its README names each "
          "log's command)"),
    Entry(("gpu/spread_kernel",), GPU_SESSION, "-", "1 GPU", "bash tools/gpu_session.sh setup spread; "
          "bash tools/planner_ncu.sh topoep_plus_spread 32 640 (its README)"),
    Entry(("gpu/spread_scan",), GPU_SESSION, "-", "1 GPU", "bash tools/gpu_session.sh setup spread; "
          "bash tools/planner_ncu.sh topoep_plus_spread 32 640 (its README)"),
    Entry(("gpu/spread_move_cost",), GPU_SESSION, "-", "1 GPU", "bash tools/gpu_session.sh setup spread; "
          "pytest tests/test_planner_cuda.py -k extension_checks"),
    Entry(("gpu/serial_guard",), GPU_SESSION, "-", "1 GPU", "TOPOEP_GPU_SHARE=1 TOPOEP_GPU_WORLD=8 TOPOEP_GPU_RPD=4 "
          "pytest tests/test_cuda_backend_gpu.py -k guarded_topoep_plus (its README)"),
    Entry(("gpu/dedupe",), GPU_SESSION, "-", "1 GPU", "pytest tests/test_planner_cuda.py tests/test_peers_cuda.py"),
    Entry(("gpu/ext_errors",), GPU_SESSION, "-", "1 GPU", "pytest tests/test_planner_cuda.py::"
          "test_extension_checks_raise_their_messages tests/test_peers_cuda.py tests/test_spread_cuda.py "
          "tests/test_guard_cuda.py (its README)"),
    Entry(("gpu/guard_pipeline",), GPU_SESSION, "-", "1 GPU", "pytest tests/test_guard_cuda.py; TOPOEP_GPU_SHARE=1 "
          "TOPOEP_GPU_WORLD=8 TOPOEP_GPU_RPD=4 pytest tests/test_cuda_backend_gpu.py -k guarded_topoep_plus (its README)"),
    Entry(("gpu/guard_kernel",), GPU_SESSION, "-", "1 GPU", "GUARD_LAYER=0 bash tools/gpu_session.sh setup guard; "
          "GUARD_KERNEL=0 bash tools/gpu_session.sh guard (its README names each log's command)"),
    Entry(("gpu/grouped_gemm",), GPU_SESSION, "-", "1 GPU", "bash tools/gpu_session.sh setup gemm (its README names "
          "the second run's options)"),
    Entry(("gpu/guard_skip",), GPU_SESSION, "-", "1 GPU", "bash tools/gpu_session.sh setup guard"),
    Entry(("gpu/hint_skip",), GPU_SESSION, "-", "1 GPU", "bash tools/gpu_session.sh setup guard"),
    Entry(("gpu/layer_limit",), GPU_SESSION, "-", "1 GPU", "bash tools/gpu_session.sh setup limit; "
          "bash tools/gpu_session.sh setup local (its README names each run's options)"),
    Entry(("gpu/deepep",), GPU_SESSION, "-", "1 GPU", "bash tools/gpu_session.sh deepep, with .deepep/ carried (its "
          "README names each run's options)"),
    Entry(("gpu/meta_graph",), GPU_SESSION, "-", "1 GPU", "bash tools/gpu_session.sh setup meta (its README names "
          "the other run's commands)"),
    Entry(("gpu/relay",), GPU_SESSION, "-", "1 GPU", "RELAY_PART=1 bash tools/gpu_session.sh setup relay; "
          "RELAY_PART=2 bash tools/gpu_session.sh relay"),
    Entry(("gpu/fetch_overlap",), GPU_SESSION, "-", "1 GPU", "bash tools/gpu_session.sh setup fetch_overlap"),
    Entry(("gpu/relay_async",), GPU_SESSION, "-", "1 GPU", "the commands in its README (a part of "
          "bash tools/gpu_session.sh setup relay_async)"),
    Entry(("gpu/verify_28f58f0",), GPU_SESSION, "-", "1 GPU", "VERIFY_TIMEOUT=360 bash tools/gpu_session.sh setup "
          "verify"),
    Entry(("gpu/verify_6d24f18",), GPU_SESSION, "-", "1 GPU", "VERIFY_EP8=0 VERIFY_AUDIT=0 bash tools/gpu_session.sh "
          "setup verify (its README names the options)"),
    Entry(("gpu/verify_2890182_h100",), GPU_SESSION, "-", "1 GPU (H100)", "VERIFY_TIMEOUT=420 VERIFY_EP8_WORKERS=3 "
          "bash tools/gpu_session.sh setup verify; then step limit and bench/grouped_gemm.py (its README names them)"),
    Entry(("gpu/guard_overlap_h100",), GPU_SESSION, "-", "1 GPU (H100)", "the commands in its README "
          "(tests/test_guard_cuda.py, the layer with fetch_overlap at EP 2, bench/guard_latency.py)"),
    Entry(("gpu/plan_domain_h200",), GPU_SESSION, "-", "1 GPU (H200)", "bash tools/gpu_session.sh setup plan_domain; "
          "bench/guard_latency.py and --rpd 64 (results/gpu/README.md)"),
    Entry(("gpu/decision_4b23704_h100",), GPU_SESSION, "-", "1 GPU (H100)", "bash tools/gpu_session.sh setup relay_nic "
          "decision (DECISION_PART 1 and 2); bench/planner_latency.py --rpd 64 --eps 16 32 64 (results/gpu/README.md)"),
    Entry(("gpu/relay_async_88ddfdf_h100",), GPU_SESSION, "-", "1 GPU (H100)", "the commands in its README "
          "(tests/test_cuda_backend_gpu.py at EP 8 with async relays; bench/planner_latency.py, --spread)"),
    Entry(("gpu/copy_kernels",), "bench/copy_kernels.py", "-", "1 GPU", "bash tools/gpu_session.sh setup copy_kernels "
          "(python bench/copy_kernels.py)"),
    Entry(("gpu/relay_chunks",), GPU_SESSION, "-", "1 GPU", "bash tools/gpu_session.sh setup relay_chunks (its "
          "README names the second run's options)"),
    Entry(("gpu/cuda_backend_tests_*.log", "gpu/sync_audit_*.log"), GPU_SESSION, "-", "2 GPUs",
          "bash tools/gpu_session.sh setup cuda",
          "Backend cuda's GPU tests (tests/test_cuda_backend_gpu.py) and the sync audit (tools/sync_audit.py), "
          "one log per commit"),
    Entry(("gpu/cuda_backend_a2a_tests_*.log",), GPU_SESSION, "-", "2 GPUs", "A2A_BENCH=0 bash tools/gpu_session.sh "
          "setup a2a", "Backend cuda's GPU tests on transport a2a, 2 GPUs as 2 virtual domains, one log per commit"),
    Entry(("gpu/cuda_backend_ep1_*.log",), GPU_SESSION, "-", "1 GPU", "bash tools/gpu_session.sh setup ep1_paths",
          "Backend cuda's GPU tests at EP 1 with two token chunks and with the second bank of replica slots"),
    Entry(("gpu/ep1_topoep_plus_*.log",), "tests/test_cuda_backend_gpu.py", "-", "1 GPU",
          "TOPOEP_GPU_WORLD=1 python -m pytest tests/test_cuda_backend_gpu.py",
          "Backend cuda's GPU tests at EP 1 with topoep_plus among the policies (three of the tests, chosen by hand)"),
    Entry(("gpu/glm45air-pp2-*.log",), GPU_SESSION, "-", "2 GPUs", "bash tools/gpu_session.sh setup pp",
          "GLM-4.5-Air at pipeline parallelism 2, 10 steps (the step runs eplb=topoep; the eplb=none log is the same "
          "command with eplb=none)"),
    Entry(("gpu/layer_memory",), GPU_SESSION, "-", "1 GPU", "bash tools/gpu_session.sh setup memory",
          "Raw runs of bench/layer_memory.py at EP 1, 2, 4, 8 (read by results/layer_memory.md)"),
    Entry(("gpu/layer_repeat_*",), GPU_SESSION, "-", "2 GPUs", "TOKENS=4096 bash tools/gpu_session.sh setup layer_cuda",
          "A repeat of the backend cuda layer tables at 4096 tokens per rank"),
    Entry(("gpu/moe_layer_profile_ep2_4096.txt",), "bench/moe_layer.py", "-", "2 GPUs",
          "torchrun --nproc_per_node=2 bench/moe_layer.py --tokens 4096 --skews -4 --layouts concentrated "
          "--backends torch --no-megatron --torch-profile",
          "torch.profiler tables of one layer on backend torch, 4096 tokens per rank (the script's "
          "moe_layer_profile.txt; the command is read off the cases in the file)"),
    Entry(("gpu/planner_ncu_top_*.txt",), "tools/planner_ncu.sh", "-", "1 GPU", "bash tools/planner_ncu.sh",
          "Nsight Compute stall samples of the CUDA planner by source line (tools/ncu_top_lines.py)"),
    Entry(("gpu/planner_repeat_*",), "bench/planner_latency.py", "-", "1 GPU", "python bench/planner_latency.py",
          "A repeat of the planner latency report on another H200"),
    Entry(("gpu/planner_tests*.log",), GPU_SESSION, "-", "1 GPU", "bash tools/gpu_session.sh setup planner",
          "The CUDA planner's GPU tests (tests/test_planner_cuda.py; `quick`: PLANNER_QUICK=1), one log per commit"),
    Entry(("gpu/profile_*",), "bench/moe_layer.py", "-", "2 GPUs",
          "torchrun --nproc_per_node=2 bench/moe_layer.py --name prof --backends cuda --no-megatron --slots 2 --tokens "
          "4096 --skews 0 --layouts random --iters 10 --profile-iters 0 --torch-profile"),
    Entry(("gpu/qwen3-none.log", "gpu/qwen3-topoep.log", "gpu/qwen3-*-metrics.jsonl"), GPU_SESSION, "-", "2 GPUs",
          "bash tools/gpu_session.sh setup train",
          "Qwen3, EP 2, 50 steps, eplb=none and eplb=topoep on backend torch: console lines and every logged metric"),
    Entry(("gpu/qwen3-*-backend-*.log",), GPU_SESSION, "-", "2 GPUs",
          "STEPS=30 bash tools/gpu_session.sh setup train_backends",
          "Qwen3, EP 2, 30 steps: megatron, TopoEP on backend torch, on backend cuda (console lines)"),
    Entry(("gpu/runtime_gpu_tests_*.log",), GPU_SESSION, "-", "2 GPUs", "bash tools/gpu_session.sh setup tests",
          "Backend torch's GPU tests (tests/test_runtime_gpu.py)"),
    Entry(("gpu/shared_ep2_*",), GPU_SESSION, "-", "1 GPU", "bash tools/gpu_session.sh setup shared"),
    Entry(("gpu/shared_ep8_*",), GPU_SESSION, "-", "1 GPU", "bash tools/gpu_session.sh setup shared_ep8"),
    Entry(("gpu/train_*",), GPU_SESSION, "-", "2 GPUs", "STEPS=20 bash tools/gpu_session.sh setup train_backends"),
    Entry(("gpu/weighting_ep1",), "bench/moe_layer.py", "-", "1 GPU",
          "torchrun --nproc_per_node=1 bench/moe_layer.py --name prof1 --backends cuda --no-megatron --slots 2 "
          "--tokens 16384 4096 --skews 0 --layouts random --iters 10 --profile-iters 2 --torch-profile"),
]


def listed(root: Path = RESULTS) -> list[str]:
    """What the index must cover: every file at the top of results/ and every entry (file or folder) of results/gpu/,
    as paths relative to results/."""
    top = [p.name for p in root.iterdir() if p.is_file()]
    gpu = [f"gpu/{p.name}" for p in (root / "gpu").iterdir()] if (root / "gpu").is_dir() else []
    return sorted(top + gpu)


def matches(entry: Entry, names: list[str]) -> list[str]:
    return [n for n in names if any(fnmatch.fnmatchcase(n, pat) for pat in entry.files)]


def unmatched(root: Path = RESULTS) -> list[str]:
    names = listed(root)
    return [n for n in names if not any(matches(e, [n]) for e in REPORTS + GPU)]


def heading(root: Path, files: list[str]) -> str | None:
    """The first markdown heading of the entry's first .md file (or of a folder's README.md)."""
    for name in files:
        path = root / name
        md = path / "README.md" if path.is_dir() else path
        if md.suffix == ".md" and md.is_file():
            for line in md.read_text().splitlines():
                if line.startswith("#"):
                    return line.lstrip("#").strip()
    return None


def _files_cell(root: Path, files: list[str], gpu: bool) -> str:
    """Each file by name (the part after gpu/ in the gpu table); markdown files and folders as links."""
    out = []
    for name in files:
        folder = (root / name).is_dir()
        short = (name.removeprefix("gpu/") if gpu else name) + ("/" if folder else "")
        out.append(f"[{short}]({name}{'/' if folder else ''})" if name.endswith(".md") or folder else f"`{short}`")
    return ", ".join(out)


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def render(root: Path = RESULTS) -> str:
    names = sorted(set(listed(root)) | {"README.md"})  # the index lists itself, also before its first write
    lines = [
        "# Results: index and provenance\n",
        "Written by `python tools/results_index.py` (the table of producers is in that script; "
        "`tests/test_results_index.py` checks that it covers every file here). Each report names the commit, date and "
        "hardware it was made with; the commands below make it again.\n",
        "## Reports\n",
        "| files | title | script | reads | runs on | command |",
        "|---|---|---|---|---|---|"]
    for e in REPORTS:
        files = matches(e, names)
        title = "; ".join(t for t in (heading(root, files), e.what) if t)
        lines.append(_row([_files_cell(root, files, gpu=False), title, f"`{e.script}`", e.reads, e.where,
                           f"`{e.command}`"]))
    lines += [
        "\n## gpu/: records of GPU runs\n",
        "Logs, raw runs and the notes written with them, as they came back from the GPU machine "
        "(`tools/gpu_session.sh` runs the steps; file and folder names carry the commit whose tree ran). Rerunning a "
        "step makes new records; it does not rewrite these.\n",
        "| files | what | script | runs on | command |",
        "|---|---|---|---|---|"]
    for e in GPU:
        files = matches(e, names)
        lines.append(_row([_files_cell(root, files, gpu=True), e.what or heading(root, files) or "-",
                           f"`{e.script}`", e.where, f"`{e.command}`" if e.command != "-" else "-"]))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only check: no write; exit 1 when something is missing")
    args = ap.parse_args(argv)
    missing = unmatched()
    if missing:
        print("not in tools/results_index.py's tables: " + ", ".join(missing), file=sys.stderr)
        return 1
    text = render()
    index = RESULTS / "README.md"
    if args.check:
        if not index.is_file() or index.read_text() != text:
            print("results/README.md is stale: run python tools/results_index.py", file=sys.stderr)
            return 1
        return 0
    index.write_text(text)
    print(f"wrote {index.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
