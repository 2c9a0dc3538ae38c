"""The experts' grouped GEMMs with CUTLASS's Hopper grouped GEMM under tiles and schedules of our choosing: candidates
for backend cuda's weight gradients (and, with 64-row tiles, its forward and data-gradient GEMMs), measured by
`bench/grouped_gemm.py --cutlass` against torch._grouped_mm.

`grouped_wgrad(a, b, offs, config)` computes what `topoep_research.grouped_gemm.grouped_wgrad` and
`torch._grouped_mm(a.t(), b, offs=offs)` compute: out[g] = a[rows of g]^T b[rows of g] for a [A, P], b [A, Q], groups
by their int32 end offsets, out [G, P, Q] in bf16 summed in fp32, zeros for a group without rows
(`topoep_research.grouped_gemm.wgrad_reference` is its torch form). `grouped_mm(a, b, offs, config)` computes
`torch._grouped_mm(a, b, offs=offs)` for a [A, K] and b [G, K, N] (N contiguous, or the transpose(1, 2) of a
contiguous [G, N, K]): out[rows of g] = a[rows of g] b[g]. `csrc/cutlass_wgrad.cu` says why tiles and schedules of our
own may beat torch's on the layer's shapes (about 256 rows per group at 4096 tokens: each weight-gradient tile's
epilogue is as long as its main loop; on random routing a group just over a multiple of 128 rows pays a whole extra
128-row tile). WGRAD_CONFIGS and MM_CONFIGS name the compiled configurations.

Building needs nvcc (the CUDA toolkit; `topoep.planners.cuda.cuda_home`) and CUTLASS's headers: `CUTLASS_HOME` (a
CUTLASS checkout), else the `nvidia-cutlass` package (`pip install --no-deps nvidia-cutlass==4.2.0`, which ships
them). Its 13 configurations take 10-15 minutes on 2 cores; build here, carry `build/cutlass_wgrad_*` to the GPU
machine (`tools/gpu_session.sh` step `cutlass`), which loads the built library without CUTLASS. The layer never uses
it unless a benchmark swaps it in (`as_grouped_mm`).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SOURCE = Path(__file__).resolve().parent / "csrc" / "cutlass_wgrad.cu"
CUTLASS_VERSION = "4.2.0"
# the kernel configurations of csrc/cutlass_wgrad.cu, by index: schedule, tile M x N x K, cluster (torch's choice for
# these shapes is cooperative 128x256x64 with a cluster of 2x1: the control)
WGRAD_CONFIGS = ("pingpong 128x128x64", "pingpong 128x128x64 cluster 2x1", "pingpong 64x128x64",
                 "cooperative 128x256x64 cluster 2x1", "cooperative 128x128x64")
MM_CONFIGS = ("pingpong 64x128x64", "pingpong 64x256x64", "cooperative 128x128x64",
              "cooperative 128x256x64 cluster 2x1")
_module = None


def build_dir() -> Path:
    """build/cutlass_wgrad_<hash of the source>: a changed source builds anew."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    return ROOT / "build" / f"cutlass_wgrad_{digest}"


def cutlass_include() -> list[str]:
    """CUTLASS's include directories (the library's and its tools' util headers), or a RuntimeError saying how to
    get them."""
    home = os.environ.get("CUTLASS_HOME")
    if home:
        root = Path(home)
    else:
        spec = importlib.util.find_spec("cutlass_library")
        if spec is None or spec.origin is None:
            raise RuntimeError("building the CUTLASS weight-gradient kernel needs CUTLASS's headers: pip install "
                               f"--no-deps nvidia-cutlass=={CUTLASS_VERSION} (its headers), or set CUTLASS_HOME to a "
                               "CUTLASS checkout")
        root = Path(spec.origin).parent / "source"
    dirs = [root / "include", root / "tools" / "util" / "include"]
    missing = [str(d) for d in dirs if not d.is_dir()]
    if missing:
        raise RuntimeError(f"CUTLASS's headers are not where expected ({', '.join(missing)}): set CUTLASS_HOME to a "
                           "CUTLASS checkout (with include/ and tools/util/include/)")
    return [str(d) for d in dirs]


def library_path() -> Path:
    return build_dir() / "cutlass_wgrad.so"


def load(build: bool = True, verbose: bool = False):
    """The compiled module: loaded from build_dir() if built there, else built (`build`) or a RuntimeError."""
    global _module
    if _module is not None:
        return _module
    lib = library_path()
    if not lib.exists():
        if not build:
            raise RuntimeError(f"the CUTLASS weight-gradient kernel is not built ({lib} is missing): build it on a "
                               "machine with nvcc, python -c 'from topoep_research.cutlass_wgrad import load; load()', "
                               "and carry build/ with the run")
        from torch.utils import cpp_extension

        from topoep.planners.cuda import cuda_home

        home = cuda_home()
        if home is None:
            raise RuntimeError("building the CUTLASS weight-gradient kernel needs nvcc (the CUDA toolkit); set "
                               "CUDA_HOME")
        include = cutlass_include()
        os.environ["CUDA_HOME"] = home
        cpp_extension.CUDA_HOME = home
        lib.parent.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(name="cutlass_wgrad", sources=[str(SOURCE)], build_directory=str(lib.parent),
                           extra_include_paths=include, extra_cflags=["-O3"],
                           extra_cuda_cflags=["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-DNDEBUG",
                                              "-gencode=arch=compute_90a,code=sm_90a"],
                           with_cuda=True, verbose=verbose)
    spec = importlib.util.spec_from_file_location("cutlass_wgrad", lib)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _module = module
    return module


def check_config(config, configs: tuple[str, ...] = WGRAD_CONFIGS) -> int:
    """The index of a configuration among `configs` (an index or a name), or a ValueError naming the choices."""
    if isinstance(config, str) and config in configs:
        return configs.index(config)
    if isinstance(config, int) and not isinstance(config, bool) and 0 <= config < len(configs):
        return config
    raise ValueError(f"config {config!r} is none of the compiled configurations: an index 0..{len(configs) - 1} or "
                     f"one of {', '.join(configs)}")


def grouped_wgrad(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, config=0) -> torch.Tensor:
    """out [G, P, Q] = per group g, a[rows of g]^T b[rows of g] (module docstring): a [A, P], b [A, Q] contiguous bf16
    on one GPU, offs int32 [G] non-decreasing with offs[-1] <= A. No host synchronisation."""
    index = check_config(config)
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[0]:
        raise ValueError(f"grouped_wgrad: a {tuple(a.shape)} and b {tuple(b.shape)} must be [A, P] and [A, Q]")
    if not (a.is_cuda and b.is_cuda and offs.is_cuda):
        raise ValueError("grouped_wgrad runs on a GPU: a, b and offs must be CUDA tensors (wgrad_reference elsewhere)")
    return load(build=False).grouped_wgrad(a, b, offs, index)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, config=0) -> torch.Tensor:
    """out [A, N] = per group g, a[rows of g] b[g] (module docstring): a [A, K] contiguous, b [G, K, N] with N contiguous
    or the transpose(1, 2) of a contiguous [G, N, K], bf16 on one GPU; rows past offs[-1] are left unwritten. No host
    synchronisation."""
    index = check_config(config, MM_CONFIGS)
    if a.dim() != 2 or b.dim() != 3 or a.shape[1] != b.shape[1] or b.shape[0] != offs.numel():
        raise ValueError(f"grouped_mm: a {tuple(a.shape)}, b {tuple(b.shape)} and offs {tuple(offs.shape)} must be "
                         "[A, K], [G, K, N] and [G]")
    if not (a.is_cuda and b.is_cuda and offs.is_cuda):
        raise ValueError("grouped_mm runs on a GPU: a, b and offs must be CUDA tensors (torch._grouped_mm elsewhere)")
    return load(build=False).grouped_mm(a, b, offs, index)


def as_grouped_mm(wgrad_config=0, mm_config=0):
    """A function with torch._grouped_mm's contract, `(a, b, offs=...)`, that runs the two forms of backend cuda's
    expert GEMMs on these kernels: K-grouped (a the transpose of a contiguous [A, P], b a contiguous [A, Q]: the weight
    gradients) with `grouped_wgrad` in configuration `wgrad_config`, M-grouped (a a contiguous [A, K], b [G, K, N]
    contiguous or the transpose(1, 2) of a contiguous [G, N, K]) with `grouped_mm` in `mm_config`; anything else
    (another dtype, the CPU) with torch._grouped_mm. For `topoep.runtime.cuda_function.GROUPED_MM` in a benchmark
    (`bench/layer_limit.py --cutlass`)."""
    wgrad_index, mm_index = check_config(wgrad_config), check_config(mm_config, MM_CONFIGS)
    lib = load(build=False)

    def grouped(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None) -> torch.Tensor:
        form = call_form(a, b) if offs is not None and a.is_cuda and a.dtype == b.dtype == torch.bfloat16 else None
        if form == "wgrad":
            return lib.grouped_wgrad(a.t(), b, offs, wgrad_index)
        if form == "mm":
            return lib.grouped_mm(a, b, offs, mm_index)
        return torch._grouped_mm(a, b, offs=offs)

    return grouped


def call_form(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """Which kernel of this module computes torch._grouped_mm(a, b, offs=...) for these operands' shapes and strides:
    "wgrad" (a the transpose of a contiguous [A, P], b a contiguous [A, Q]), "mm" (a a contiguous [A, K], b [G, K, N]
    contiguous or the transpose(1, 2) of a contiguous [G, N, K]), or None (torch._grouped_mm)."""
    if a.dim() != 2:
        return None
    if b.dim() == 2 and a.t().is_contiguous() and b.is_contiguous():
        return "wgrad"
    if b.dim() == 3 and a.is_contiguous() and (b.is_contiguous() or b.transpose(1, 2).is_contiguous()):
        return "mm"
    return None


@contextlib.contextmanager
def swapped_grouped_mm(kernel):
    """Backend cuda's expert GEMMs (`topoep.runtime.cuda_function.GROUPED_MM`) run `kernel` (e.g. `as_grouped_mm()`)
    inside the block, forward and backward alike; the default comes back after it, also after an error."""
    from topoep.runtime import cuda_function

    default, cuda_function.GROUPED_MM = cuda_function.GROUPED_MM, kernel
    try:
        yield
    finally:
        cuda_function.GROUPED_MM = default
