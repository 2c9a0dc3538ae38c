"""Train a megatron-core MoE model with TopoEP in its MoE blocks.

    torchrun --nproc_per_node=8 train.py model=qwen3 eplb=topoep trainer=default
    torchrun --standalone --nproc_per_node=4 train.py model=tiny trainer=cpu eplb=topoep   # CPU, 2 virtual domains

Config groups (configs/, typed in app/config.py): model, eplb, router, topology, parallel, trainer,
logger, data. This file only assembles: compose the config, validate it, hand it to app.loop.
"""

import hydra
from omegaconf import DictConfig

from app.config import register_configs
from app.loop import job_from_config, run

register_configs()


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(cfg: DictConfig) -> None:
    run(*job_from_config(cfg))


if __name__ == "__main__":
    main()
