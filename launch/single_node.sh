#!/usr/bin/env bash
# One node, all its GPUs: launch/single_node.sh model=qwen3 eplb=topoep trainer=default [overrides...]
# NPROC (default: number of visible GPUs) processes; a node is one NVLink domain (topology=node).
set -euo pipefail
source "$(dirname "$0")/env.sh"
NPROC=${NPROC:-$("$TOPOEP_PYTHON" -c 'import torch; print(max(torch.cuda.device_count(), 1))')}
cd "$TOPOEP_ROOT"
exec "$TOPOEP_PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" train.py "$@"
