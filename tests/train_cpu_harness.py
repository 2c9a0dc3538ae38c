"""train.py for the tests: the same job, with eplb.backend=cuda's layers on the internal CPU harness (backend cuda's
code on CPU processes over gloo, torch references for its kernels), which is not a config value.

    torchrun --standalone --nproc_per_node=4 tests/train_cpu_harness.py model=tiny trainer=cpu eplb.backend=cuda
"""

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.config import register_configs  # noqa: E402
from app.loop import config_errors, job_from_config, run  # noqa: E402

register_configs()


@hydra.main(version_base="1.3", config_path="../configs", config_name="config")
def main(cfg: DictConfig) -> None:
    with config_errors():
        job, resolved = job_from_config(cfg)
    run(job, resolved, cpu_harness=True)


if __name__ == "__main__":
    main()
