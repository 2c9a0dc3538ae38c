#!/usr/bin/env bash
# CPU smoke run: 4 gloo processes as 2 virtual domains, the tiny model, offline data and logging.
#   launch/cpu_smoke.sh [overrides...]
set -euo pipefail
source "$(dirname "$0")/env.sh"
cd "$TOPOEP_ROOT"
exec "$TOPOEP_PYTHON" -m torch.distributed.run --standalone --nproc_per_node="${NPROC:-4}" train.py \
  model=tiny trainer=cpu eplb=topoep trainer.steps=5 trainer.run_dir=runs/cpu-smoke "$@"
