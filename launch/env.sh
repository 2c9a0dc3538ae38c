# Environment shared by every launcher (sourced). NVLink multicast stays off: it can take a shared
# host's GPUs out of service (NCCL NVLS, torch symmetric-memory multicast, NVSHMEM NVLS).
export NCCL_NVLS_ENABLE=0
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_DISABLE_NVLS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
export WANDB_MODE=${WANDB_MODE:-offline}
# The Python that has the project installed (default: the repo's .venv, else python3 on PATH).
TOPOEP_ROOT=${TOPOEP_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
if [ -z "${TOPOEP_PYTHON:-}" ]; then
  if [ -x "$TOPOEP_ROOT/.venv/bin/python" ]; then TOPOEP_PYTHON=$TOPOEP_ROOT/.venv/bin/python; else TOPOEP_PYTHON=python3; fi
fi
export TOPOEP_ROOT TOPOEP_PYTHON
