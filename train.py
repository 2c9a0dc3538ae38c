"""Train a megatron-core MoE model with TopoEP in its MoE blocks.

    torchrun --nproc_per_node=8 train.py model=qwen3 eplb=topoep trainer=default
    torchrun --standalone --nproc_per_node=4 train.py model=tiny trainer=cpu eplb=topoep   # CPU, 2 virtual domains

Config groups (configs/, typed in app/config.py): model, eplb, router, topology, parallel, trainer,
logger, data. This file only assembles: compose the config, validate it, hand it to app.loop.
"""

import hydra
from omegaconf import DictConfig, OmegaConf

from app.config import GROUPS, register_configs
from app.loop import Job, run
from data.store import to_data_config

register_configs()


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(cfg: DictConfig) -> None:
    parts = {g: OmegaConf.to_object(cfg[g]) for g in GROUPS}  # runs every __post_init__ check
    resolved = OmegaConf.to_container(cfg, resolve=True)
    resolved["_yaml"] = OmegaConf.to_yaml(cfg, resolve=True)
    run(Job(**parts, data=to_data_config(cfg.data)), resolved)


if __name__ == "__main__":
    main()
