"""Console, metrics.jsonl and W&B logging (rank 0 only)."""

from __future__ import annotations

import json
from pathlib import Path

from app.config import LoggerConfig


class Logger:
    """Prints one line per step, appends every metric to <run_dir>/metrics.jsonl, and mirrors both to
    W&B (offline by default: the run lands in <run_dir>/wandb, `wandb sync` uploads it later). Every W&B run of a run
    directory is in the group named after it; a run resumed from a checkpoint logs into a W&B run of its own, named
    <run_dir name>-from-<checkpoint> (its steps after the checkpoint would repeat steps the interrupted W&B run may
    have logged, which W&B refuses within one run)."""

    def __init__(self, cfg: LoggerConfig, run_dir: Path, config: dict, enabled: bool, fresh: bool = True,
                 resumed_from: str | None = None):
        self.enabled = enabled
        self.run_dir = run_dir
        self.wandb = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        # a fresh run starts a new metrics file; a resumed one appends to it
        self.metrics_file = open(run_dir / "metrics.jsonl", "w" if fresh else "a", buffering=1)
        if cfg.name == "wandb":
            try:
                import wandb
            except ImportError as err:
                raise ValueError("logger=wandb needs the wandb package (pip install wandb) or use logger=none") from err
            name = run_dir.name if resumed_from is None else f"{run_dir.name}-from-{resumed_from}"
            self.wandb = wandb.init(project=cfg.project, entity=cfg.entity, mode=cfg.mode, dir=str(run_dir),
                                    config=config, name=name, group=run_dir.name)
            print(f"W&B run ({cfg.mode}): {self.wandb.dir}", flush=True)

    def resume_at(self, step: int) -> None:
        """A run resumed from the checkpoint of `step`: the metrics file keeps only its rows up to that step (the
        steps after it run again and are logged anew, so no step appears twice)."""
        if not self.enabled:
            return
        self.metrics_file.close()
        path = self.run_dir / "metrics.jsonl"
        rows = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        path.write_text("".join(f"{line}\n" for line in rows))
        self.metrics_file = open(path, "a", buffering=1)

    def log(self, step: int, metrics: dict, line: str | None = None) -> None:
        if not self.enabled:
            return
        if line:
            print(line, flush=True)
        self.metrics_file.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def log_image(self, step: int, name: str, path: Path) -> None:
        if self.enabled and self.wandb is not None:
            import wandb

            self.wandb.log({name: wandb.Image(str(path))}, step=step)

    def finish(self) -> None:
        if not self.enabled:
            return
        self.metrics_file.close()
        if self.wandb is not None:
            self.wandb.finish()
