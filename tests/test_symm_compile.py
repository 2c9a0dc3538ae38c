"""The Triton kernels of backend cuda's copy-by-copy relayed fetch and gradient return (topoep/runtime/symm.py,
LayerConfig.relay_schedule "async") compile for Hopper (sm_90) on this CPU-only machine: Triton's front end, its type
checks and ptxas all run here, so a kernel that would not compile fails here and not first on the GPU. Whether they
move the right bytes is tested on the GPU (tests/test_cuda_backend_gpu.py's relay tests)."""

import pytest

triton = pytest.importorskip("triton", reason="needs Triton (the torch CUDA wheel's) to compile the kernels")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from topoep.runtime import symm  # noqa: E402

# argument types (everything not listed: int32); pointers by name
POINTERS = {
    "_push_slots_async_kernel": {"items": "*i64", "count": "*i64", "slot_expert": "*i64", "main_ptrs": "*i64",
                                 "own_slots": "*bf16", "pool_bases": "*i64", "flags": "*i32", "flag_bases": "*i64",
                                 "epoch_ptr": "*i32"},
    "_push_grads_async_kernel": {"items": "*i64", "count": "*i64", "slot_expert": "*i64", "source": "*i64",
                                 "children": "*i64", "pool": "*bf16", "ret": "*bf16", "ret_bases": "*i64",
                                 "flags": "*i32", "flag_bases": "*i64", "epoch_ptr": "*i32"},
}


@pytest.mark.parametrize("name", sorted(POINTERS))
def test_async_relay_kernels_compile_for_hopper(name):
    fn = getattr(symm, name)
    constexprs = {"CHUNK": symm.COPY_CHUNK}
    signature = {arg: "constexpr" if arg in constexprs else POINTERS[name].get(arg, "i32") for arg in fn.arg_names}
    compiled = triton.compile(ASTSource(fn, signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32))
    ptx = compiled.asm["ptx"]
    assert compiled.asm["cubin"]  # ptxas accepted it
    # the flags: a system-scope release on the sender's side and an acquire on the waiter's
    assert "sys.release" in ptx and "sys.acquire" in ptx
