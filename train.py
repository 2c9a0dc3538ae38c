"""Train a megatron-core MoE model with TopoEP in its MoE blocks.

    torchrun --nproc_per_node=8 train.py model=qwen3 eplb=topoep
    torchrun --standalone --nproc_per_node=4 train.py model=tiny trainer=cpu eplb=topoep   # CPU, 2 virtual domains

Config groups (configs/, typed in app/config.py; docs/config.md): model, eplb, router, topology, parallel,
trainer, logger, data. Without a `trainer=` argument the trainer profile follows the machine: `default` (GPU,
bf16) when CUDA is available, `cpu` (gloo, fp32, 2 virtual domains) otherwise. This file only assembles: choose
the profile, compose the config, validate it, hand it to app.loop.
"""

import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from app.config import register_configs
from app.loop import config_errors, job_from_config, run

register_configs()


def trainer_profile(argv: list[str]) -> tuple[list[str], str]:
    """(argv with the trainer profile chosen, the header line that says which and why)."""
    given = [a for a in argv[1:] if a.split("=")[0].lstrip("+~") == "trainer"]
    if given:
        return argv, f"trainer profile: {given[-1].split('=', 1)[-1]} (from the command line)"
    import torch

    name = "default" if torch.cuda.is_available() else "cpu"
    why = "CUDA is available" if name == "default" else "no CUDA device"
    return argv + [f"trainer={name}"], (f"trainer profile: {name} ({why}; pass trainer=default or trainer=cpu to "
                                        "choose)")


def check_composition(argv: list[str]) -> None:
    """Compose the config from the command line's overrides once before Hydra's run, so that an override Hydra
    cannot apply (an unknown group option, a value of the wrong type) is reported like every config error: once,
    by rank 0, naming the field."""
    from hydra import compose, initialize_config_dir

    overrides = [a for a in argv[1:] if not a.startswith(("-", "hydra.", "+hydra.", "~hydra."))]
    with config_errors(), initialize_config_dir(config_dir=str(Path(__file__).resolve().parent / "configs"),
                                                version_base="1.3"):
        compose("config", overrides=overrides)


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(cfg: DictConfig) -> None:
    with config_errors():
        job, resolved = job_from_config(cfg)
    run(job, resolved)


if __name__ == "__main__":
    sys.argv, header = trainer_profile(sys.argv)
    if int(os.environ.get("RANK", "0")) == 0:
        print(header, flush=True)
    check_composition(sys.argv)
    main()
