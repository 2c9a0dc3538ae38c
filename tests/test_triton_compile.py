"""CPU test: every Triton kernel of backend `cuda` (topoep/runtime/symm.py, layout_triton.py, weighting.py, spill.py,
stats_triton.py, worth_triton.py, gate_triton.py) compiles for sm_90 (H100/H200)
without a GPU, with the argument types the backend passes. Catches type and syntax errors before any GPU
time; that the kernels compute the right thing is checked on the GPU (tests/test_cuda_backend_gpu.py)."""

import inspect

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, compile  # noqa: E402

import topoep.runtime.gate_triton as GT  # noqa: E402
import topoep.runtime.layout_triton as LT  # noqa: E402
import topoep.runtime.spill as SP  # noqa: E402
import topoep.runtime.stats_triton as ST  # noqa: E402
import topoep.runtime.symm as S  # noqa: E402
import topoep.runtime.weighting as W  # noqa: E402
import topoep.runtime.worth_triton as WT  # noqa: E402

I64, I32 = "*i64", "i32"
KERNELS = {
    "_gather_row_kernel": (dict(src=I64, n=I32, bases=I64, me=I32), dict(BLOCK=1024)),
    "_dispatch_kernel": (dict(src="*bf16", order=I64, row_div=I32, dest=I64, pos=I64, is_slot="*i8", meta_base=I32,
                              main_bases=I64, slot_bases=I64, main_meta_bases=I64, slot_meta_bases=I64,
                              overflow="*i32", n_rows=I32, region_end=I32, scale="*bf16", stage="*bf16",
                              stage_meta=I64, stage_base=I32, src2="*bf16", stage2="*bf16", me=I32,
                              local_main="*bf16", local_slot="*bf16", local_base=I32),
                         dict(H=2048, BLOCK_H=2048, HAS_SCALE=True, SPILL=True, HAS_SRC2=True, LOCAL=True)),
    "_combine_kernel": (dict(y="*bf16", meta=I64, n_ptr=I64, back_bases=I64, a_cap=I32, cap=I32, me=I32),
                        dict(H=2048, BLOCK_H=2048, SKIP_LOCAL=True)),
    "_copy_rows_kernel": (dict(dst="*bf16", src="*bf16", n_ptr=I64, cap=I32, meta=I64, a_cap=I32, me=I32),
                          dict(H=1536, BLOCK_H=2048, SKIP_LOCAL=True)),
    "_push_slots_kernel": (dict(slot_expert=I64, source=I64, level=I64, step=I32, chunks=I32, span=I32,
                                main_ptrs=I64, own_slots="*bf16", pool_bases=I64, me=I32, e_loc=I32, N=I32,
                                numel=I32),
                           dict(CHUNK=S.COPY_CHUNK, RELAY=True, ALIGN=16)),
    "_push_grads_kernel": (dict(slot_expert=I64, source=I64, level=I64, step=I32, levels=I32, chunks=I32, span=I32,
                                pool="*bf16", ret_bases=I64, me=I32, e_loc=I32, N=I32, numel=I32),
                           dict(CHUNK=S.COPY_CHUNK, RELAY=True, ALIGN=16)),
    # the copy-by-copy fetch and return (LayerConfig.relay_schedule "async")
    "_push_slots_async_kernel": (dict(items=I64, count=I64, slot_expert=I64, main_ptrs=I64, own_slots="*bf16",
                                      pool_bases=I64, flags="*i32", flag_bases=I64, flag_row=I32, epoch_ptr="*i32",
                                      me=I32, e_loc=I32, N=I32, numel=I32, n_chunks=I32, chunk0=I32),
                                 dict(CHUNK=S.COPY_CHUNK, ALIGN=16)),
    "_push_grads_async_kernel": (dict(items=I64, count=I64, slot_expert=I64, source=I64, children=I64, pool="*bf16",
                                      ret="*bf16", ret_bases=I64, flags="*i32", flag_bases=I64, flag_row=I32,
                                      epoch_ptr="*i32", me=I32, N=I32, numel=I32, n_chunks=I32, chunk0=I32,
                                      FANOUT=I32),
                                 dict(CHUNK=S.COPY_CHUNK, ALIGN=16)),
    "_swiglu_fwd_kernel": (dict(h="*bf16", act="*bf16", n_ptr=I64, cap=I32), dict(F=768, BLOCK_F=1024)),
    "_swiglu_bwd_kernel": (dict(grad_act="*bf16", h="*bf16", grad_h="*bf16", act="*bf16", n_ptr=I64, cap=I32),
                           dict(F=768, BLOCK_F=1024)),
    "_reduce_grads_kernel": (dict(slot_expert=I64, source=I64, level=I64, lv=I32, step=I32, levels=I32, chunks=I32,
                                  span=I32, ret="*bf16", grad="*bf16", me=I32, e_loc=I32, N=I32, RN=I32, numel=I32),
                             dict(CHUNK=S.COPY_CHUNK, RELAY=True, SLOTS=True, ALIGN=16)),
    # layout_triton.py, with Qwen3-30B-A3B's 128 experts at EP 8 and 2 slots
    "_block_counts_kernel": (dict(e_ptr=I64, counts_ptr=I64, ok_ptr="*i1", A=I32, E=I32, nb=I32),
                             dict(B=LT.BLOCK, EB=256, CHECK=True)),
    "_tables_kernel": (dict(C_ptr=I64, route_ptr=I64, inst_expert_ptr=I64, counts_ptr=I64, key_start_ptr=I64,
                            recv_start_ptr=I64, inst_start_ptr=I64, rep_first_ptr=I64, rep_count_ptr=I64,
                            rep_list_ptr=I64, first_ptr=I64, offs_main_ptr="*i32", offs_slot_ptr="*i32", n_ptr=I64,
                            ok_ptr="*i1", me=I32, rows=I32, A=I32, R=I32, E=I32, E_loc=I32, G=I32, S=I32, nb=I32),
                       dict(RB=8, GB=32, SB=16, EB=256, QB=LT.TABLE_SLOTS, EC=LT.TABLE_EXPERTS, NB=LT.TABLE_COLS)),
    "_layout_kernel": (dict(e_ptr=I64, first_ptr=I64, route_ptr=I64, inst_rank_ptr=I64, inst_start_ptr=I64,
                            rep_first_ptr=I64, rep_count_ptr=I64, rep_list_ptr=I64, key_start_ptr=I64,
                            recv_start_ptr=I64, order_ptr=I64, key_ptr=I64, dest_ptr=I64, pos_ptr=I64,
                            slot_ptr="*i8", inv_ptr=I64, me=I32, region_rows=I32, A=I32, E=I32, E_loc=I32, N=I32,
                            G=I32, nb=I32), dict(B=LT.BLOCK, INV=True)),
    # spill.py, Qwen3's expert shape
    "_spill_rows_kernel": (dict(tile_end=I64, n_sg=I64, first_sg=I64, n_pairs=I32, G=I32, E_loc=I32, xs_bases=I64,
                                gs_bases=I64, meta_bases=I64, back_bases=I64, main1="i64", main2="i64", slot1="i64",
                                slot2="i64"),
                           dict(H=2048, F=768, BM=SP.BM, BK=SP.BK, BF=SP.BF, BH=SP.BH, BACKWARD=True, FP32=False)),
    "_spill_wgrad_kernel": (dict(n_sg=I64, first_sg=I64, groups=I64, num_groups=I64, R=I32, G=I32, E_loc=I32,
                                 g_lo=I32, g_hi=I32, xs_bases=I64, gs_bases=I64, main1="i64", main2="i64",
                                 slot1="i64", slot2="i64", gmain1="i64", gmain2="i64", gslot1="i64", gslot2="i64"),
                            dict(H=2048, F=768, BM=SP.BM, BK=SP.BK, BF=SP.BF, BH=SP.BH, FP32=False)),
    "_spill_work_kernel": (dict(C=I64, prev=I64, n_out=I64, first_out=I64, tile_end_out=I64, groups_out=I64,
                                num_groups_out=I64, rows_out=I64, R=I32, G=I32, rank=I32, e_loc=I32, region_rows=I32),
                           dict(HAS_PREV=True, TILE=SP.BM, BLOCK_R=64, BLOCK_G=32)),
    # stats_triton.py, 32 ranks, 640 experts, 2 slots
    "_plan_stats_kernel": (dict(route=I64, omega=I64, slot_expert=I64, dom=I64, cost="*fp64", consts="*fp64",
                                scratch="*fp64", out="*fp64", R=I32, E=I32, N=I32, P=I32, E_loc=I32),
                           dict(BLOCK_P=1024, BLOCK_R=32, BLOCK_E=1024, BLOCK_RN=64)),
    # worth_triton.py, 32 ranks, 640 experts
    "_worth_kernel": (dict(omega=I64, consts="*fp64", partial=I64, counter="*i32", out="*i1", R=I32, E=I32,
                           E_loc=I32, NPROG=I32), dict(BLOCK_S=32, BLOCK_RB=2, BLOCK_L=32, BLOCK_P=16)),
    # gate_triton.py: the spread gate's update
    "_gate_kernel": (dict(state="*fp64", flag="*i1", worth="*i1", ran="*i1", fired="*i1", saved="*fp64", cost="*fp64",
                          choice=I64, spread_s="*fp64", first_spread=I32, probe=I32), {}),
    # weighting.py, Qwen3's hidden size and top-8
    "_weighted_sum_kernel": (dict(rows="*bf16", w="*bf16", y="*bf16", save="*bf16", inv=I64, lmain="*bf16",
                                  lslot="*bf16", lcap=I32, T=I32),
                             dict(K=8, H=2048, BLOCK=1024, SAVE=True, WEIGHTED=True, LOCAL=True)),
    "_row_dots_kernel": (dict(g="*bf16", rows="*bf16", out="*fp32", T=I32), dict(K=8, H=2048, BLOCK=1024)),
}
MODULES = (S, LT, W, SP, ST, WT, GT)


def _kernel(name):
    return next(getattr(m, name) for m in MODULES if hasattr(m, name))


def test_every_kernel_is_listed():
    found = {n for m in MODULES for n in dir(m) if n.endswith("_kernel") and hasattr(getattr(m, n), "fn")}
    assert found == set(KERNELS)


# other specialisations the backend launches: (kernel, constexprs that differ)
VARIANTS = [("_weighted_sum_kernel", dict(SAVE=False, WEIGHTED=False)),  # weighting.sum_choices
            ("_weighted_sum_kernel", dict(LOCAL=False)),  # every row from the combine (a2a, two chunks)
            ("_layout_kernel", dict(INV=False)),  # two chunks, the a2a workspace
            ("_block_counts_kernel", dict(CHECK=False)),  # the layout's counts (ok_ptr not read)
            ("_dispatch_kernel", dict(HAS_SCALE=False, HAS_SRC2=False)),  # the forward dispatch
            ("_dispatch_kernel", dict(HAS_SCALE=False, SPILL=False, HAS_SRC2=False)),  # without a capacity
            ("_dispatch_kernel", dict(HAS_SCALE=True, LOCAL=False)),  # the backward dispatch
            ("_combine_kernel", dict(SKIP_LOCAL=False)),
            ("_copy_rows_kernel", dict(SKIP_LOCAL=False)),
            ("_spill_rows_kernel", dict(BACKWARD=False)),  # the forward spill
            # replica transfers from the homes (relay_fanout=None), and the homes' sum of a relayed return
            ("_push_slots_kernel", dict(RELAY=False)),
            ("_push_grads_kernel", dict(RELAY=False)),
            ("_reduce_grads_kernel", dict(RELAY=False, SLOTS=False)),
            ("_reduce_grads_kernel", dict(SLOTS=False))]
# the replica copies where a weight or a pointer is not 16-byte aligned (symm._aligned: one element per access)
COPIES = ("_push_slots_kernel", "_push_grads_kernel", "_reduce_grads_kernel", "_push_slots_async_kernel",
          "_push_grads_async_kernel")
VARIANTS += [(name, dict(ALIGN=2)) for name in COPIES]


def _compiled(name, changed=None, divisible=()):
    """Kernel `name` compiled for sm_90 with KERNELS' argument types and constexprs (`changed` replacing some), the
    integer arguments in `divisible` declared multiples of 16 (as Triton's launcher specialises them)."""
    fn = _kernel(name)
    sig, const = KERNELS[name]
    const = const | (changed or {})
    params = list(inspect.signature(fn.fn).parameters)
    assert set(sig) | set(const) == set(params), "signature out of date"
    src = ASTSource(fn=fn, signature={p: sig.get(p, "constexpr") for p in params},
                    constexprs={(params.index(k),): v for k, v in const.items()},
                    attrs={(params.index(p),): [["tt.divisibility", 16]] for p in divisible})
    return compile(src, target=GPUTarget("cuda", 90, 32))


@pytest.mark.parametrize("name,changed", [(n, {}) for n in sorted(KERNELS)] + VARIANTS)
def test_kernel_compiles_for_sm90(name, changed):
    assert _compiled(name, changed).asm["cubin"]  # ptxas produced sm_90 machine code


@pytest.mark.parametrize("name", ["_push_slots_async_kernel", "_push_grads_async_kernel"])
def test_copy_by_copy_kernels_signal_across_gpus(name):
    """The copy-by-copy kernels' flags: a system-scope release where a chunk is signalled, a system-scope acquire
    where one is awaited (what makes another GPU's stores visible before the flag)."""
    ptx = _compiled(name).asm["ptx"]
    assert "sys.release" in ptx and "sys.acquire" in ptx


@pytest.mark.parametrize("name", COPIES)
def test_aligned_copies_move_16_bytes_per_access_without_spills(name):
    """With ALIGN=16 every weight load and store of a replica copy is a 16-byte vector (ld/st .v4.b32 in the PTX,
    no 2-byte ones), and ptxas keeps the kernel in registers: no stack (spills), at most 128 registers per thread
    (read from the cubin with the cuobjdump Triton ships)."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    kernel = _compiled(name, divisible=("numel",))
    ptx = kernel.asm["ptx"]
    assert re.search(r"ld\.global[.a-z0-9]*\.v4\.b32", ptx) and re.search(r"st\.global[.a-z0-9]*\.v4\.b32", ptx)
    assert not re.search(r"(ld|st)\.global[.a-z0-9]*\.b16", ptx)
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    regs, stack = (int(x) for x in re.search(r"REG:(\d+) STACK:(\d+)", usage).groups())
    assert stack == 0 and regs <= 128, usage
