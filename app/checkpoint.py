"""Checkpoints with megatron distributed checkpointing: model and optimizer as sharded tensors (so a
checkpoint loads with another policy, eplb=none included), plus the step, LR scheduler, data position
and per-rank RNG states: Python's, numpy's, torch's, megatron's per-stream tracker (the synthetic and balanced
routers draw their logits from it) and megatron's cached router biases. Layout: <dir>/iter_0000010/
(+ rng_<rank>.pt) and <dir>/latest. A resumed run continues the checkpoint's LR schedule (megatron's rule; the
trainer says where its config's differs)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing


def _unwrap(ddp):
    return ddp.module


def _state(ddp, optimizer, is_loading: bool) -> dict:
    model_sd = _unwrap(ddp).sharded_state_dict()
    return {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading)}


def _rng_state() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    from megatron.core.transformer.moe.moe_utils import RandomSTEShared

    out = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
           "tracker": get_cuda_rng_tracker().get_states(),
           "router_bias": {k: v.detach().cpu() for k, v in RandomSTEShared._cache.items()}}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def save_checkpoint(root: str | Path, step: int, ddp, optimizer, scheduler, loader) -> Path:
    root = Path(root)
    path = root / f"iter_{step:07d}"
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = _state(ddp, optimizer, is_loading=False)
    state.update(step=step, scheduler=scheduler.state_dict(), loader=loader.state_dict())
    dist_checkpointing.save(state, str(path))
    torch.save(_rng_state(), path / f"rng_{dist.get_rank()}.pt")
    dist.barrier()
    if dist.get_rank() == 0:
        tmp = root / "latest.tmp"
        tmp.write_text(path.name + "\n")
        tmp.replace(root / "latest")
    dist.barrier()
    return path


def latest_checkpoint(root: str | Path) -> Path | None:
    marker = Path(root) / "latest"
    return Path(root) / marker.read_text().strip() if marker.exists() else None


def load_checkpoint(path: Path, ddp, optimizer, scheduler, loader) -> int:
    """Restore everything saved by `save_checkpoint`; returns the step it was saved at."""
    state = _state(ddp, optimizer, is_loading=True)
    loaded = dist_checkpointing.load(state, str(path))
    _unwrap(ddp).load_state_dict(loaded["model"])
    try:
        optimizer.load_state_dict(loaded["optimizer"])
    except ValueError as err:
        if "parameter group" not in str(err):
            raise
        saved = loaded["scheduler"]
        raise ValueError(f"{path}'s optimizer was saved with other trainer.lr, trainer.min_lr or trainer.weight_decay "
                         f"(its schedule: max_lr {saved.get('max_lr')}, min_lr {saved.get('min_lr')}, weight decay "
                         f"{saved.get('end_wd')}): resume with its values, or set trainer.resume=false to start "
                         "anew") from None
    scheduler.load_state_dict(loaded["scheduler"])
    loader.load_state_dict(loaded["loader"])
    rng_file = path / f"rng_{dist.get_rank()}.pt"
    if rng_file.exists():
        rng = torch.load(rng_file, weights_only=False)
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
        if "tracker" in rng:
            from megatron.core.tensor_parallel import get_cuda_rng_tracker
            from megatron.core.transformer.moe.moe_utils import RandomSTEShared

            get_cuda_rng_tracker().set_states(rng["tracker"])
            device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
            for k, v in rng["router_bias"].items():  # megatron's own biases (layout megatron) as drawn
                RandomSTEShared._cache.setdefault(k, v.to(device))
    return int(loaded["step"])
