"""The decode GEMV, RoPE (with the q/k norm) and the MoE kernels compile for sm_90 on any machine: Triton's compiler
and its bundled ptxas run without a GPU.

The interpreter that runs the other kernel tests on the CPU accepts code the compiler rejects (plain globals in jit
code, type errors in branches a constexpr never takes, a branch that retypes a variable), and each reached the GPU
this way once (bench/RESULTS.md). This compiles `_gemv_kernel` (at M = 1 and M = 16 tiles), the descriptor (TMA)
GEMV, gemv_mma.py's and grouped_mma.py's kernels (whose inline PTX the interpreter only emulates), RoPE, the
grouped MoE kernel and the combine's in a subprocess without TRITON_INTERPRET, the GEMVs with and without the fused
LoRA, and checks ptxas' register report: no spills, and the M = 1 tile kernel within 168 registers per thread, which
keeps the 12 one-warp programs per SM that configs._GEMV asks for resident (65,536 / (12 * 32) = 170).
"""

import functools

from tests.kernels.sm90_compile import compile_report, needs_sm90_compiler

_SCRIPT = r"""
import inspect, json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from orbit_lightning.kernels import gemv
from tests.kernels.sm90_compile import ptxas_usage

names = list(inspect.signature(gemv._gemv_kernel.fn).parameters)
pointers = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "gs_ptr": "*bf16", "out_ptr": "*bf16",
            "ws_ptr": "*fp32", "cnt_ptr": "*i32", "la0": "*bf16", "la1": "*bf16", "la2": "*bf16", "lb0": "*bf16",
            "lb1": "*bf16", "lb2": "*bf16", "lpart": "*fp32", "lt": "*i64", "lcnt": "*i32", "stamp_ptr": "*i64"}
base = dict(FMT=1, GROUP=32, BM=16, BK=128, DOT=True, K_EVEN=True, FAST_INT4=True, SPLIT=True, PDL=True, BR=16,
            STAMPS=False)
tiles = {"m1": dict(BN=16, TWO=True, PREFETCH=True, ONE_ROW=True), "m16": dict(BN=32, TWO=False, PREFETCH=False,
                                                                                 ONE_ROW=False)}
def ptxas_report(src, **options):
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    usage = ptxas_usage(compiled.asm["ptx"])
    layouts = sorted({line.split(" = ", 1)[1] for line in compiled.asm["ttgir"].splitlines()
                      if line.startswith("#blocked")})
    return {"registers": usage["registers"], "spills": usage["spills"], "layouts": layouts}


report = {}
for tile, kw in tiles.items():
    for lora in (False, True):
        const = dict(base, LORA=lora, **kw)
        sig = {n: "constexpr" if n in const else pointers.get(n, "fp32" if n in ("ls0", "ls1", "ls2") else "i32")
               for n in names}
        constexprs = {(names.index(k),): v for k, v in const.items()}
        src = ASTSource(fn=gemv._gemv_kernel, signature=sig, constexprs=constexprs)
        report[f"{tile}-lora{int(lora)}"] = ptxas_report(src, num_warps=1)
const = dict(base, LORA=True, STAMPS=True, **tiles["m1"])  # the timeline build (kernels/timeline.py)
sig = {n: "constexpr" if n in const else pointers.get(n, "fp32" if n in ("ls0", "ls1", "ls2") else "i32")
       for n in names}
src = ASTSource(fn=gemv._gemv_kernel, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()})
report["m1-lora1-stamps"] = ptxas_report(src, num_warps=1)
names = list(inspect.signature(gemv._gemv_tma_kernel.fn).parameters)
pointers.update(w_desc="tensordesc<i32[32, 32]>", s_desc="tensordesc<bf16[32, 8]>")
for lora in (False, True):  # the descriptor kernel as configs._GEMV_TALL runs it (M = 1, no split)
    const = dict(GROUP=32, BM=16, BN=32, BK=256, FAST_INT4=True, SPLIT=False, ONE_ROW=True, STAGES=4, PDL=True,
                 LORA=lora, BR=16, STAMPS=lora)  # (the LoRA build with the timeline too)
    sig = {n: "constexpr" if n in const else pointers.get(n, "fp32" if n in ("ls0", "ls1", "ls2") else "i32")
           for n in names}
    constexprs = {(names.index(k),): v for k, v in const.items()}
    src = ASTSource(fn=gemv._gemv_tma_kernel, signature=sig, constexprs=constexprs)
    report[f"tma-lora{int(lora)}"] = ptxas_report(src, num_warps=1)

from orbit_lightning.kernels import gemv_mma
from orbit_lightning.kernels.configs import GemvConfig

names = list(inspect.signature(gemv_mma._gemv_mma_kernel.fn).parameters)
for mt, nt, nw, lora, u, pairs, tiled in (
        (1, 1, 8, False, 2, False, False), (1, 1, 8, True, 2, False, False), (2, 1, 8, False, 2, False, False),
        (1, 1, 4, False, 1, False, False), (1, 2, 8, True, 1, False, False), (1, 2, 8, False, 1, True, False),
        (2, 1, 8, True, 2, True, False), (1, 1, 8, False, 2, False, True),
        (1, 2, 8, False, 1, True, True)):  # shipped M = 1 first; nt 2 serves 8 < M <= 16; int4-tiled's last
    cfg = GemvConfig(16, 16 * mt, 128, mma=True, mma_tiles=u, l2_prefetch=128, mma_word_pairs=pairs)
    const = dict(gemv_mma.kernel_constexprs(cfg, 1 if nt == 1 else 16, nw, 32, 18432 // 8, 18432 // 32, True, tiled),
                 LORA=lora, BR=16, STAMPS=False)  # K 18432
    sig = {n: "constexpr" if n in const else pointers.get(n, "fp32" if n in ("ls0", "ls1", "ls2") else "i32")
           for n in names}
    src = ASTSource(fn=gemv_mma._gemv_mma_kernel, signature=sig,
                    constexprs={(names.index(k),): v for k, v in const.items()})
    report[f"mma-mt{mt}-nt{nt}-u{u}-lora{int(lora)}" + ("-pairs" * pairs) + ("-tiled" * tiled)] = ptxas_report(
        src, num_warps=nw)

import importlib

rope = importlib.import_module("orbit_lightning.kernels.rope")  # (the package exports the function under that name)
names = list(inspect.signature(rope._rope_kernel.fn).parameters)
pointers = {n: "*bf16" for n in ("q_ptr", "k_ptr", "qo_ptr", "ko_ptr", "qw_ptr", "kw_ptr")}
pointers.update(cos_ptr="*fp32", sin_ptr="*fp32", eps="fp32")
for norm in (False, True):
    const = dict(D=128, BLOCK_D=128, BLOCK_H=8, INTERLEAVE=False, NORM=norm, PDL=True)
    sig = {n: "constexpr" if n in const else pointers.get(n, "i32") for n in names}
    src = ASTSource(fn=rope._rope_kernel, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()})
    report[f"rope-norm{int(norm)}"] = ptxas_report(src, num_warps=4, enable_fp_fusion=False)

from orbit_lightning.kernels import configs, grouped

moe_combine = importlib.import_module("orbit_lightning.kernels.moe_combine")  # (shadowed by its function)

names = list(inspect.signature(grouped._grouped_kernel.fn).parameters)
pointers = {"a_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "gs_ptr": "*bf16", "out_ptr": "*bf16"}
for dx, offsets in ((False, "*i32"), (True, "*i32"), (False, "*i64")):  # the shipped decode bucket (MoE decode)
    cfg = configs._FAST["grouped_dx" if dx else "grouped_fwd"][0][1]
    const = dict(FMT=1, GROUP=32, DX=dx, SWAP=cfg.swap_ab, BM=cfg.block_m, BP=cfg.block_p, BR=cfg.block_r,
                 PREC="tf32", K_EVEN=True, FAST_INT4=True, E_POW2=128)
    sig = {n: "constexpr" if n in const else dict(pointers, offsets_ptr=offsets).get(n, "i32") for n in names}
    src = ASTSource(fn=grouped._grouped_kernel, signature=sig,
                    constexprs={(names.index(k),): v for k, v in const.items()})
    report[f"grouped-dx{int(dx)}-{offsets[1:]}"] = ptxas_report(src, num_warps=cfg.num_warps,
                                                                num_stages=cfg.num_stages)
for kernel, const in ((moe_combine._slot_sum_kernel, dict(WEIGHTED=True, BLOCK=1024, PDL=True)),
                      (moe_combine._combine_backward_kernel, dict(YS_GRAD=True, W_GRAD=True, BLOCK=1024))):
    names = list(inspect.signature(kernel.fn).parameters)
    sig = {n: "constexpr" if n in const else ("*bf16" if n.endswith("_ptr") else "i32") for n in names}
    sig.update({n: "*i64" for n in ("inv_ptr", "order_ptr") if n in sig})
    src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()})
    report[kernel.fn.__name__] = ptxas_report(src, num_warps=4, enable_fp_fusion=False)
grouped_mma = importlib.import_module("orbit_lightning.kernels.grouped_mma")
names = list(inspect.signature(grouped_mma._grouped_mma_kernel.fn).parameters)
pointers = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "w2_ptr": "*i32", "s2_ptr": "*bf16",
            "out_ptr": "*bf16", "offsets_ptr": "*i32", "u_ptr": "*bf16", "b_ptr": "*bf16", "b2_ptr": "*bf16",
            "scale": "fp32"}
for mt, u, swiglu, lora, tiled in ((1, 2, False, 0, False), (2, 2, False, 0, False), (1, 1, False, 0, False),
                                   (2, 2, True, 0, False), (2, 2, True, 16, False), (2, 2, False, 16, False),
                                   (2, 2, True, 8, False), (2, 2, True, 64, False), (1, 1, False, 0, True),
                                   (2, 2, True, 16, True)):  # _GROUPED_MMA's, with LoRA rank; int4-tiled's last
    cfg = GemvConfig(16, 16 if swiglu else 16 * mt, 128, mma=True, num_warps=4, mma_tiles=u, l2_prefetch=128)
    const = dict(grouped_mma.kernel_constexprs(cfg, 32, 4, 128, swiglu, lora, True, tiled), STRIDE_W=2048 // 8,
                 STRIDE_S=2048 // 32)
    sig = {n: "constexpr" if n in const else pointers.get(n, "i32") for n in names}
    src = ASTSource(fn=grouped_mma._grouped_mma_kernel, signature=sig,
                    constexprs={(names.index(k),): v for k, v in const.items()})
    name = (("mma-grouped-swiglu" if swiglu else f"mma-grouped-mt{mt}-u{u}") + (f"-lora{lora}" if lora else "")
            + ("-tiled" if tiled else ""))
    report[name] = ptxas_report(src, num_warps=4, enable_fp_fusion=False, enable_reflect_ftz=False)
grouped_lora = importlib.import_module("orbit_lightning.kernels.grouped_lora")
names = list(inspect.signature(grouped_lora._lora_a_kernel.fn).parameters)
for rank in (16, configs.GROUPED_MMA_MAX_RANK):  # the engine's, and the largest the dispatch takes
    const = dict(J=2, R=rank, R_POW2=rank, BM=16, BK=128, E_POW2=128, PREC="tf32", UPCAST=False, PDL=True)
    sig = {n: "constexpr" if n in const else {"offsets_ptr": "*i32"}.get(n, "*bf16" if n.endswith("_ptr") else "i32")
           for n in names}  # fmt: skip
    src = ASTSource(fn=grouped_lora._lora_a_kernel, signature=sig,
                    constexprs={(names.index(k),): v for k, v in const.items()})
    report["_lora_a_kernel" + ("" if rank == 16 else f"-r{rank}")] = ptxas_report(src, num_warps=4)
moe_route = importlib.import_module("orbit_lightning.kernels.moe_route")
names = list(inspect.signature(moe_route._softmax_topk_kernel.fn).parameters)
const = dict(K=8, RENORM=True, BT=16, E_POW2=128, PDL=True)  # as softmax_topk launches E = 128
sig = {n: "constexpr" if n in const else {"logits_ptr": "*bf16", "w_ptr": "*bf16", "ids_ptr": "*i64"}.get(n, "i32")
       for n in names}  # fmt: skip
src = ASTSource(fn=moe_route._softmax_topk_kernel, signature=sig,
                constexprs={(names.index(k),): v for k, v in const.items()})
report["_softmax_topk_kernel"] = ptxas_report(src, num_warps=4)
moe_sort = importlib.import_module("orbit_lightning.kernels.moe_sort")
names = list(inspect.signature(moe_sort._sort_kernel.fn).parameters)
const = dict(N_POW2=4096, BINS=512, PDL=True)
sig = {n: "constexpr" if n in const else {"ids_ptr": "*i64", "offsets_ptr": "*i32"}.get(n, "*i64" if
       n.endswith("_ptr") else "i32") for n in names}  # fmt: skip
src = ASTSource(fn=moe_sort._sort_kernel, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()})
report["_sort_kernel"] = ptxas_report(src, num_warps=8)
print(json.dumps(report))
"""


@functools.cache
def _report() -> dict:
    """The script's per-kernel report (compiled once for this module's tests)."""
    return compile_report(_SCRIPT)


@needs_sm90_compiler
def test_decode_gemv_compiles_for_sm90_within_its_register_budget():
    report = _report()
    assert set(report) == {"m1-lora0", "m1-lora1", "m16-lora0", "m16-lora1", "m1-lora1-stamps", "tma-lora0",
                           "tma-lora1", "mma-mt1-nt1-u2-lora0", "mma-mt1-nt1-u2-lora1", "mma-mt2-nt1-u2-lora0",
                           "mma-mt1-nt1-u1-lora0", "mma-mt1-nt2-u1-lora1",
                           "mma-mt1-nt2-u1-lora0-pairs", "mma-mt2-nt1-u2-lora1-pairs", "mma-mt1-nt1-u2-lora0-tiled",
                           "mma-mt1-nt2-u1-lora0-pairs-tiled", "rope-norm0", "rope-norm1",
                           "grouped-dx0-i32", "grouped-dx1-i32", "grouped-dx0-i64", "_slot_sum_kernel",
                           "_combine_backward_kernel", "_sort_kernel", "_softmax_topk_kernel",
                           "mma-grouped-mt1-u2", "mma-grouped-mt2-u2",
                           "mma-grouped-mt1-u1", "mma-grouped-swiglu", "mma-grouped-swiglu-lora16",
                           "mma-grouped-mt2-u2-lora16", "mma-grouped-swiglu-lora8", "mma-grouped-swiglu-lora64",
                           "mma-grouped-mt1-u1-tiled", "mma-grouped-swiglu-lora16-tiled", "_lora_a_kernel",
                           "_lora_a_kernel-r64"}
    assert not any(r["spills"] for r in report.values()), report
    assert max(report["m1-lora0"]["registers"], report["m1-lora1"]["registers"]) <= 168, report
    # 16 rows x 128 experts per 4-warp program hold ~16 probabilities and ranks per thread: room for 2+ programs
    assert report["_softmax_topk_kernel"]["registers"] <= 200, report["_softmax_topk_kernel"]


@needs_sm90_compiler
def test_mma_gemv_keeps_one_element_per_thread_and_few_registers():
    """gemv_mma.py's inline PTX (and grouped_mma.py's, which runs its loop) assumes element i of its [32 * warps]
    tensors is thread i's register; Triton's layout for them must be one element per thread, 32 threads along a warp.
    Registers must leave room for the ~12 warps per SM the dense configs ask for (and then some): <= 128 per thread.
    The grouped kernel also holds its expert's tile bounds: <= 168, still 12 warps (three 4-warp programs) per SM."""
    report = _report()
    for name in [n for n in report if n.startswith("mma")]:
        grouped = name.startswith("mma-grouped")
        nw = 4 if name == "mma-mt1-nt1-u1-lora0" or grouped else 8
        one_per_thread = f"<{{sizePerThread = [1], threadsPerWarp = [32], warpsPerCTA = [{nw}], order = [0]}}>"
        assert f"#ttg.blocked{one_per_thread}" in report[name]["layouts"], report[name]["layouts"]
        assert report[name]["registers"] <= (168 if grouped else 128) and not report[name]["spills"], report[name]
