"""Run megatron-core 0.19 on a CPU-only machine (gloo), for tests and the CPU quickstart.

megatron-core assumes CUDA. `enable_cpu_compat()` is a no-op when CUDA is available; otherwise it
installs a small set of substitutions (see shared/notes/megatron-core.md for what breaks):

- `torch.cuda.current_device()` returns "cpu" (megatron passes it as a device argument everywhere);
- CUDA streams and events become no-op objects, `torch.cuda.synchronize` a no-op;
- a TorchFunctionMode maps device "cuda" to "cpu" in tensor factories and `.to()`/`.cuda()`, and
  reports `Tensor.type()` with the CUDA names megatron's optimizer and clip-grad code compare with;
- megatron's all-to-all receives its split sizes as Python lists (gloo needs them on the host);
- megatron's RNG tracker keeps its named streams (data-parallel, tensor-parallel, expert-parallel) in
  the CPU generator, so `model_parallel_cuda_manual_seed` works and seeds each stream as on GPUs;
- torch.compile (megatron's jit_fuser) runs eager: compiling its fused router kernels for the CPU takes
  longer than a whole smoke run.

Nothing here changes numerics: the same model on the same data gives the same losses as far as
float arithmetic on the CPU allows.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_enabled = False


class _NoStream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, event=None):
        return event or _NoEvent()

    def synchronize(self):
        pass

    def query(self):
        return True


class _NoEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _cpu_device(dev):
    if isinstance(dev, torch.device) and dev.type == "cuda":
        return torch.device("cpu")
    if isinstance(dev, str) and dev.startswith("cuda"):
        return "cpu"
    if isinstance(dev, int):  # a CUDA ordinal
        return "cpu"
    return dev


_TYPE_NAMES = {"torch.FloatTensor": "torch.cuda.FloatTensor", "torch.HalfTensor": "torch.cuda.HalfTensor",
               "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and not isinstance(args[1], (torch.dtype, torch.Tensor)):
            args = (args[0], _cpu_device(args[1]), *args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _TYPE_NAMES.get(name, name)
        return func(*args, **kwargs)


def enable_cpu_compat() -> bool:
    """Install the CPU substitutions when CUDA is absent. Returns True if they are active."""
    global _enabled
    if torch.cuda.is_available():
        return False
    if _enabled:
        return True
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.Stream = _NoStream
    torch.cuda.Event = _NoEvent
    torch.cuda.current_stream = lambda *a, **k: _NoStream()
    torch.cuda.default_stream = lambda *a, **k: _NoStream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.synchronize = lambda *a, **k: None
    _CudaToCpu().__enter__()  # process-wide: stays active for the rest of the run
    from torch import _dynamo

    _dynamo.config.disable = True
    _patch_megatron()
    _patch_rng()
    _enabled = True
    return True


def _patch_megatron() -> None:
    from megatron.core.tensor_parallel import mappings

    original = mappings.all_to_all

    def all_to_all(group, input_, output_split_sizes=None, input_split_sizes=None, **kwargs):
        def host(s):
            return s.tolist() if isinstance(s, torch.Tensor) else (list(s) if s is not None else None)

        return original(group, input_, host(output_split_sizes), host(input_split_sizes), **kwargs)

    mappings.all_to_all = all_to_all
    for mod_name in ("megatron.core.transformer.moe.token_dispatcher", "megatron.core.transformer.moe.moe_utils"):
        try:
            mod = __import__(mod_name, fromlist=["all_to_all"])
            if hasattr(mod, "all_to_all"):
                mod.all_to_all = all_to_all
        except ImportError:
            pass


def _patch_rng() -> None:
    import logging

    from megatron.core.tensor_parallel import random as mrandom

    # (torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the CPU generator directly)
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    torch.cuda.manual_seed_all = lambda seed: None
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # the tracker's streams now live in the CPU generator, so its "CPU state changed" check always fires
    logging.getLogger(mrandom.__name__).setLevel(logging.ERROR)
