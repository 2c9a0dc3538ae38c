"""Hydra side of the data configs: the ConfigStore schema behind the `data/` group, conversion of a
composed node to a validated DataConfig, and composing a named corpus config outside a Hydra app.

Apps that compose a config with the `data` group (data.build, train.py) call `register_configs()` before
Hydra composes, so that `configs/data/*.yaml` can extend the schema (`defaults: [base_data, _self_]`).
"""

from __future__ import annotations

from pathlib import Path

from data.config import DataConfig

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
SCHEMA = "base_data"


def register_configs() -> None:
    """Register DataConfig as `data/base_data` in Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group="data", name=SCHEMA, node=DataConfig)


def to_data_config(node) -> DataConfig:
    """A validated DataConfig from a composed `data` node (runs every __post_init__ check)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_object(node)


def compose_data_config(name: str = "offline", overrides: list[str] | tuple[str, ...] = ()) -> DataConfig:
    """configs/data/<name>.yaml with command-line style overrides (`data.num_tokens=1000`), composed
    with Hydra's compose API; for scripts and tests that are not Hydra apps themselves."""
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="build_data", overrides=[f"data={name}", *overrides])
    return to_data_config(cfg.data)
