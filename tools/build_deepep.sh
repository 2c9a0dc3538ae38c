#!/usr/bin/env bash
# Build a wheel of DeepEP (its V2 API, `deep_ep.ElasticBuffer`) against this environment's torch, for TopoEP's
# optional transport `deepep` (eplb.transport=deepep). DeepEP is never required: `make run` and `make test` work
# without it. Run it on a machine with the CUDA toolkit (nvcc); the GPU need not be there. Usage:
#   bash tools/build_deepep.sh DEEPEP_SRC [--fmt FMT_SRC] [--nccl-dir DIR] [--out DIR] [--install]
# DEEPEP_SRC   a checkout of github.com/deepseek-ai/DeepEP (main); its third-party/fmt submodule is needed: run
#              `git submodule update --init` there, or give --fmt with a checkout of fmtlib/fmt (>= 11)
# --nccl-dir   an NCCL >= 2.30.4 tree (include/, lib/libnccl.so.2) to build against, when the environment's
#              nvidia-nccl-cu13 is older (torch 2.11 pins 2.28.9). DeepEP requires the libnccl that torch loads at
#              run time to be this very one: install the same NCCL into the environment (pip install --no-deps
#              'nvidia-nccl-cu13>=2.30.4', or put the tree's lib first with LD_PRELOAD)
# --out        where the wheel goes (default dist/deepep); --install: pip install it into this Python, no deps
# Environment: PYTHON (default .venv/bin/python, else python3), CUDA_HOME (default the newest /usr/local/cuda-*
# that has bin/nvcc), TORCH_CUDA_ARCH_LIST (default 9.0: H100/H200; DeepEP's SM90 features), MAX_JOBS.
# At run time DeepEP compiles its kernels with nvcc (CUDA_HOME must name the toolkit root then too) into
# EP_JIT_CACHE_DIR (default ~/.deep_ep).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
die() { echo "build_deepep.sh: $*" >&2; exit 1; }
[ $# -ge 1 ] || die "usage: bash tools/build_deepep.sh DEEPEP_SRC [--fmt FMT_SRC] [--nccl-dir DIR] [--out DIR] [--install]"
src=$(cd "$1" 2>/dev/null && pwd) || die "no DeepEP source tree at $1"
shift
fmt="" nccl="" out="$here/dist/deepep" install=0
while [ $# -gt 0 ]; do
  case "$1" in
    --fmt) fmt=$(cd "$2" 2>/dev/null && pwd) || die "--fmt $2: no such folder"; shift 2 ;;
    --nccl-dir) nccl=$(cd "$2" 2>/dev/null && pwd) || die "--nccl-dir $2: no such folder"; shift 2 ;;
    --out) mkdir -p "$2"; out=$(cd "$2" && pwd); shift 2 ;;
    --install) install=1; shift ;;
    *) die "unknown argument $1" ;;
  esac
done
PYTHON=${PYTHON:-$([ -x "$here/.venv/bin/python" ] && echo "$here/.venv/bin/python" || echo python3)}
[ -f "$src/setup.py" ] && [ -f "$src/deep_ep/buffers/elastic.py" ] \
  || die "$src is not DeepEP's V2 source (no deep_ep/buffers/elastic.py): check out github.com/deepseek-ai/DeepEP main"

# the CUDA toolkit root (not a wrapper's folder: DeepEP's JIT runs <CUDA_HOME>/bin/nvcc and cuobjdump)
if [ -z "${CUDA_HOME:-}" ]; then
  CUDA_HOME=$(ls -d /usr/local/cuda-* 2>/dev/null | sort -V | while read -r d; do
    [ -x "$d/bin/nvcc" ] && echo "$d"; done | tail -1)
fi
[ -n "${CUDA_HOME:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ] || die "no nvcc under CUDA_HOME=${CUDA_HOME:-}: set CUDA_HOME to the CUDA toolkit root"
[ -x "$CUDA_HOME/bin/cuobjdump" ] || echo "build_deepep.sh: warning: $CUDA_HOME has no bin/cuobjdump: the build does \
not need it, but DeepEP's JIT does where it runs (a full CUDA toolkit there, CUDA_HOME at its root)" >&2
[ -d /usr/local/cuda/include/cccl ] \
  || die "DeepEP's setup.py reads /usr/local/cuda/include/cccl: link it, e.g. ln -s $CUDA_HOME /usr/local/cuda"
export CUDA_HOME PATH="$CUDA_HOME/bin:$PATH"
if [ ! -f "$CUDA_HOME/include/nvrtc.h" ]; then  # a toolkit without NVRTC's headers: torch's CUDA wheels have them
  inc=$("$PYTHON" -c 'import nvidia, os, glob; print(next(iter(sorted(glob.glob(os.path.join(list(nvidia.__path__)[0], "cu*", "include", "nvrtc.h")))), "").rsplit("/", 1)[0])' 2>/dev/null || true)
  [ -n "$inc" ] || die "no nvrtc.h in $CUDA_HOME/include or in $PYTHON's nvidia wheels: install the toolkit's NVRTC (cuda-nvrtc-dev)"
  export CPATH="$inc${CPATH:+:$CPATH}"
fi
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}

# fmt (header-only) in third-party/fmt
if [ ! -f "$src/third-party/fmt/include/fmt/base.h" ]; then
  [ -n "$fmt" ] || die "$src/third-party/fmt is empty: run 'git submodule update --init' in $src, or pass --fmt FMT_SRC"
  [ -f "$fmt/include/fmt/base.h" ] || die "$fmt has no include/fmt/base.h (DeepEP needs fmt >= 11)"
  mkdir -p "$src/third-party/fmt"
  cp -r "$fmt/include" "$src/third-party/fmt/"
fi

# NCCL >= 2.30.4: DeepEP's host code uses its device-API queries (ncclCommQueryProperties, ...)
nccl_version() {  # "major minor patch" of nccl.h under $1/include
  awk '/#define NCCL_(MAJOR|MINOR|PATCH) /{v[$2]=$3} END{print v["NCCL_MAJOR"], v["NCCL_MINOR"], v["NCCL_PATCH"]}' \
    "$1/include/nccl.h"
}
if [ -z "$nccl" ]; then
  nccl=$("$PYTHON" - <<'EOF'
import importlib.util, os
spec = importlib.util.find_spec("nvidia.nccl")
print(os.path.join(list(spec.submodule_search_locations)[0]) if spec else "")
EOF
)
  [ -n "$nccl" ] || die "no nvidia-nccl-cu13 in $PYTHON's environment: pass --nccl-dir"
fi
[ -f "$nccl/include/nccl.h" ] || die "$nccl has no include/nccl.h"
read -r maj min pat < <(nccl_version "$nccl")
if [ $((maj * 10000 + min * 100 + pat)) -lt 23004 ]; then
  die "NCCL $maj.$min.$pat at $nccl: DeepEP V2 needs NCCL >= 2.30.4 (torch 2.11 ships 2.28.9). Install a newer one \
into this environment (pip install --no-deps 'nvidia-nccl-cu13>=2.30.4'; pip warns about torch's pin, and torch then \
runs on it) or pass --nccl-dir with an NCCL >= 2.30.4 tree"
fi
export NCCL_DIR="$nccl" LIBRARY_PATH="$nccl/lib${LIBRARY_PATH:+:$LIBRARY_PATH}"  # setup.py links -l:libnccl.so.2
# setup.py links -lcuda, the driver: on a machine without it, the toolkit's link stub (or an empty one with the
# driver's soname; the driver provides the symbols where DeepEP runs)
if ! ldconfig -p 2>/dev/null | grep -q "libcuda.so " && [ ! -f "$CUDA_HOME/lib64/stubs/libcuda.so" ]; then
  stub=$(mktemp -d)
  echo "" | gcc -x c -shared -o "$stub/libcuda.so" -Wl,-soname,libcuda.so.1 - || die "could not make a libcuda link stub"
  export LIBRARY_PATH="$stub:$LIBRARY_PATH"
elif [ -f "$CUDA_HOME/lib64/stubs/libcuda.so" ]; then
  export LIBRARY_PATH="$CUDA_HOME/lib64/stubs:$LIBRARY_PATH"
fi
# NVSHMEM's IBGDA headers (DeepEP's legacy kernels) include rdma-core's mlx5dv.h
[ -f /usr/include/infiniband/mlx5dv.h ] || die "no /usr/include/infiniband/mlx5dv.h (NVSHMEM's headers need it): \
install rdma-core's headers (Debian/Ubuntu: apt-get install libibverbs-dev; RHEL: dnf install rdma-core-devel)"
"$PYTHON" -m pip install -q --disable-pip-version-check wheel ninja >/dev/null \
  || die "could not install the build tools wheel and ninja into $PYTHON's environment"

echo "building DeepEP from $src (NCCL $maj.$min.$pat at $nccl, CUDA $CUDA_HOME, arch $TORCH_CUDA_ARCH_LIST)"
mkdir -p "$out"
(cd "$src" && rm -rf build dist ./*.egg-info && "$PYTHON" setup.py -q bdist_wheel -d "$out") \
  || die "DeepEP's build failed (log above)"
whl=$(ls -t "$out"/deep_ep-*.whl | head -1)
echo "wheel: $whl"
if [ "$install" = 1 ]; then
  "$PYTHON" -m pip install -q --no-deps --force-reinstall "$whl"
  (cd /tmp && "$PYTHON" -c 'import deep_ep; print("deep_ep", deep_ep.__version__, "imports")')
fi
