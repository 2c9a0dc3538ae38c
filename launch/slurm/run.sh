#!/usr/bin/env bash
# Body of the sbatch recipes: one srun task per node, each starting torchrun for that node's GPUs;
# torchrun's c10d rendezvous on the first node joins them. Node = NVLink domain (topology=node).
set -euo pipefail
source "${TOPOEP_ROOT:-$SLURM_SUBMIT_DIR}/launch/env.sh"
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
PORT=${RDZV_PORT:-29500}
NPROC=${NPROC:-${SLURM_GPUS_ON_NODE:-8}}
# Inter-node fabric (adjust to the cluster): InfiniBand for NCCL and NVSHMEM.
export NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-0}
export NVSHMEM_REMOTE_TRANSPORT=${NVSHMEM_REMOTE_TRANSPORT:-ibrc}
cd "$TOPOEP_ROOT"
srun --ntasks-per-node=1 --kill-on-bad-exit=1 \
  "$TOPOEP_PYTHON" -m torch.distributed.run --nnodes="$SLURM_JOB_NUM_NODES" --nproc_per_node="$NPROC" \
  --rdzv_backend=c10d --rdzv_endpoint="$HEAD:$PORT" --rdzv_id="${SLURM_JOB_ID:-topoep}" \
  train.py "$@"
