"""Run many `train.py` jobs in one torchrun (bench/paper_eval.py launches it):

    torchrun --nproc_per_node=2 bench/eval_worker.py plan.json

plan.json: a list of {"name": ..., "out": run directory, "overrides": [Hydra overrides, as train.py takes
them, with trainer.run_dir=out]}. When a job starts, rank 0 writes its overrides.json and host.json (date,
commit, hardware, processes) into its directory and removes an earlier metrics.jsonl.

The jobs run one after the other in the same processes: the process group, megatron's parallel state (when the
layout is the same) and the CUDA context are set up once instead of once per configuration, which is most of a
short benchmark run's time. Every job still builds its own model, optimizer, data loader and layers from its
own seed, and megatron's per-layer router-bias cache is cleared between jobs (app.setup.init_model_parallel),
so a job trains exactly as it would alone in `train.py`. Jobs of one plan should share their parallel layout
(paper_eval's do): a job with another layout rebuilds megatron's groups, and the symmetric-memory workspaces
of backend cuda, cached per group name, stay allocated for the old ones.

Rank 0 prints one line per finished job ("[i/n] name: ... tok/s ..."). A failing job stops the worker with
its traceback (the other ranks would wait on its collectives); the jobs before it are complete, so
`paper_eval.py --resume` continues from there.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

REPO = Path(__file__).resolve().parent.parent


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: torchrun ... bench/eval_worker.py PLAN.json")
    plan = json.loads(Path(argv[0]).read_text())
    if not isinstance(plan, list) or not plan:
        raise SystemExit(f"{argv[0]}: expected a non-empty list of jobs")
    for i, job in enumerate(plan):
        if not any(o.startswith("trainer.run_dir=") for o in job.get("overrides", [])):
            raise SystemExit(f"{argv[0]}: job {i} ({job.get('name')!r}) sets no trainer.run_dir=...")

    import torch
    import torch.distributed as dist

    from app.config import register_configs
    from app.loop import job_from_config, run
    from bench.common import run_info

    register_configs()
    rank = int(os.environ.get("RANK", 0))
    for i, spec in enumerate(plan, 1):
        t0 = time.perf_counter()
        if rank == 0 and spec.get("out"):
            out = Path(spec["out"])
            out.mkdir(parents=True, exist_ok=True)
            (out / "metrics.jsonl").unlink(missing_ok=True)
            (out / "overrides.json").write_text(json.dumps(spec["overrides"]))
            host = {k: v for k, v in run_info({}).items() if k != "config"}
            (out / "host.json").write_text(json.dumps({**host, "nproc": int(os.environ.get("WORLD_SIZE", 1))}))
        history = run(*job_from_config(compose(spec["overrides"])), keep_distributed=True)
        gc.collect()  # the job's model, optimizer and layers (and their CUDA graphs) before the next one's
        left = ""
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            left = f", {torch.cuda.memory_allocated() / 2**30:.1f} GiB left allocated"
        if history:
            tps = [m["tokens_per_s"] for m in history[len(history) // 3:]]
            print(f"[{i}/{len(plan)}] {spec['name']}: {len(history)} steps, {statistics.median(tps):,.0f} tok/s "
                  f"(median of the last two thirds), {time.perf_counter() - t0:.0f} s{left}", flush=True)
    if dist.is_initialized():
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
