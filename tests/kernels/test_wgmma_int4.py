"""The warpgroup-MMA int4 GEMM (kernels/wgmma_int4.py): it compiles for sm_90 on any machine (Triton's interpreter
cannot run Gluon, and the compile is what checks its hand-built layouts: every layout step asserts itself trivial),
and on an H200 it meets the fp64 oracle's bf16 bound where dense_gemm sends 9-512 rows of int4 on bf16.

The bound is test_gpu.py's: one rounding of each decoded weight, fp32 accumulation and one rounding of the output,
each within 2^-9 relative; 2^-8 allowed.
"""

import dataclasses
import functools
import sys

import pytest
import torch

from orbit_lightning import kernels
from tests.kernels.kernel_oracles import (
    assert_within,
    expert_offsets,
    gpu,
    matmul_bound,
    random_weight,
    row_major,
    uneven_int4_experts,
)
from tests.kernels.ptx_text import int4_decode_cases, int4_decoded_bits, run_ptx
from tests.kernels.sm90_compile import compile_report, needs_sm90_compiler

_SCRIPT = r"""
import dataclasses, inspect, json, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import mangle_type
from orbit_lightning.kernels import wgmma_int4 as wg
from orbit_lightning.kernels.wgmma_common import packed_desc, smem_layout
from tests.kernels.sm90_compile import ptxas_usage

names = list(inspect.signature(wg._wgmma_int4_kernel.fn).parameters)
report = {}
variants = [(f"bm{bm}-g{group}-split{int(split)}", wg.DECODE, bm, group, split, False)
            for bm in (16, 32, 64) for group in (32, 128) for split in (False, True)]
halves = dataclasses.replace(wg.TRAIN, halves=False, parts=1)
variants += [("train-g32", wg.TRAIN, wg.TRAIN.bm, 32, False, False),
             ("grouped-g32", wg.TRAIN, wg.TRAIN.bm, 32, False, True),
             ("grouped-g32-other-halves", halves, halves.bm, 32, False, True)]
variants += [(f"rows-{name}-g32", tile, tile.bm, 32, tile is wg.ROWS, False)
             for name, tile in (("rows", wg.ROWS), ("wide", wg.WIDE))]
other_parts = dataclasses.replace(wg.TRAIN, parts=3 - wg.TRAIN.parts)  # (one partition of MMA warps, or two)
variants += [("train-g32-other-parts", other_parts, other_parts.bm, 32, False, False),
             ("grouped-g32-other-parts", other_parts, other_parts.bm, 32, False, True)]
variants += [("bm16-g32-split1-stamps", wg.DECODE, 16, 32, True, False)]  # (bench/wgmma_timeline.py's build)
# With PDL (the dense one-partition launches on sm_90): the first steps' words go out before the wait.
variants += [(f"bm{bm}-g{group}-split{int(split)}-pdl", wg.DECODE, bm, group, split, False)
             for bm in (16, 64) for group in (32, 128) for split in (False, True)]
variants += [("rows-rows-g32-pdl", wg.ROWS, wg.ROWS.bm, 32, True, False)]
# int4-tiled weights (4-D descriptors whose boxes land as the 2-D ones): decode, PDL, training and grouped tiles
variants += [(name + "-tiled", tile, bm, group, split, grouped) for name, tile, bm, group, split, grouped in variants
             if name in ("bm16-g32-split1", "bm64-g128-split0-pdl", "train-g32", "grouped-g32")]
for name, tile, bm, group, split, grouped in variants:
    bn = 16 * tile.warps
    tiled = name.endswith("-tiled")
    x = torch.empty(bm, 4096, dtype=torch.bfloat16)
    words = torch.empty(4096, 512, dtype=torch.int32)
    scales = torch.empty(4096, 4096 // group, dtype=torch.bfloat16)
    w_box, s_box = [bn, tile.bk // 8], [bn, wg.SCALE_CHUNK.value]
    descs = {"x_desc": TensorDescriptor(x, list(x.shape), list(x.stride()), [bm, tile.bk],
                                        gl.NVMMASharedLayout.get_default_for([bm, tile.bk], gl.bfloat16)),
             "w_desc": packed_desc(words, w_box, "int32", 16, tiled),
             "s_desc": packed_desc(scales, s_box, "bf16", 8, tiled)}
    const = dict(GROUP=group, BN=bn, BM=bm, BK=tile.bk, STAGES=tile.stages, SSTAGES=wg.SCALE_STAGES,
                 SPLIT=split, GROUPED=grouped, HALVES=tile.halves, HAS_IDS=grouped, E_POW2=128 if grouped else 1,
                 PARTS=tile.parts, WORKER_REGS=wg.PART_REGS, STAMPS=name.endswith("-stamps"),
                 PDL=name.endswith("-pdl") or name.endswith("-pdl-tiled"), TILED=tiled,
                 W_SMEM=smem_layout(tuple(w_box), "int32"), S_SMEM=smem_layout(tuple(s_box), "bf16"),
                 num_warps=tile.warps // tile.parts)
    pointers = {"out_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "offsets_ptr": "*i32", "ids_ptr": "*i32",
                "stamps_ptr": "*i64"}
    sig = {n: "constexpr" if n in const else mangle_type(descs[n]) if n in descs else pointers.get(n, "i32")
           for n in names}
    # Triton's launch-time specializations (16-divisible pointers and sizes) shape the code; pass them.
    attrs = {(names.index(n),): [["tt.divisibility", 16]]
             for n in ("out_ptr", "ws_ptr", "cnt_ptr", "offsets_ptr", "ids_ptr", "stride_om", "K", "N")}
    src = GluonASTSource(fn=wg._wgmma_int4_kernel, signature=sig, attrs=attrs,
                         constexprs={(names.index(k),): v for k, v in const.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=tile.warps // tile.parts,
                                           maxnreg=tile.regs or wg.max_registers(bm, group)))
    ptx = compiled.asm["ptx"]
    usage = ptxas_usage(ptx)
    report[name] = {"bk": tile.bk, "group": group, "halves": tile.halves, "parts": tile.parts,
        "registers": usage["registers"], "spills": usage["spills"],
        "wgmma": ptx.count("wgmma.mma_async"), "tma": ptx.count("cp.async.bulk.tensor"),
        "tma4d": ptx.count("cp.async.bulk.tensor.4d"),
        "timers": ptx.count("%globaltimer") + ptx.count("%clock64"),
        "gdc_wait": ptx.count("griddepcontrol.wait"), "gdc_launch": ptx.count("griddepcontrol.launch_dependents"),
        "stages": tile.stages}
print(json.dumps(report))
"""


@functools.cache
def _report() -> dict:
    """The script's report (compiled once for this module's tests)."""
    return compile_report(_SCRIPT)


@needs_sm90_compiler
def test_compiles_for_sm90_with_trivial_layouts_and_no_spills():
    """Each shipped variant compiles (a layout step that is not trivial fails the compile), spills nothing under the
    register cap (max_registers at launch), and multiplies with wgmma on TMA-loaded tiles."""
    report = _report()
    decode = {f"bm{bm}-g{g}-split{s}" for bm in (16, 32, 64) for g in (32, 128) for s in (0, 1)}
    assert set(report) == decode | {"rows-rows-g32", "rows-wide-g32", "train-g32", "grouped-g32",
                                    "grouped-g32-other-halves", "train-g32-other-parts", "grouped-g32-other-parts",
                                    "bm16-g32-split1-stamps", "rows-rows-g32-pdl"} | {
        f"bm{bm}-g{g}-split{s}-pdl" for bm in (16, 64) for g in (32, 128) for s in (0, 1)} | {
        "bm16-g32-split1-tiled", "bm64-g128-split0-pdl-tiled", "train-g32-tiled", "grouped-g32-tiled"}
    for name, r in report.items():
        assert not r["spills"], (name, r)  # (under the cap max_registers gives: ptxas holds to it, spilling if need be)
        # BK // 16 k16 wgmmas per step, for each step of a scale chunk (8 groups: at BK = 128, 2 steps at group 32, 8
        # at 128; at the training tiles' 64, 4 steps; unrolled); the loader's TMA loads: the scale chunk, then per
        # step the words and x in 128-byte swizzle boxes (BK * 2 bytes of each row: two boxes at 128, one at 64).
        steps = kernels.wgmma_int4.SCALE_CHUNK.value * r["group"] // r["bk"]
        # (halves: one per half of the activation rows; parts: each MMA partition has its own code)
        wgmmas = r["bk"] // 16 * steps * (2 if r["halves"] else 1) * r["parts"]
        x_boxes = r["bk"] // 64
        if name.endswith("-pdl") or name.endswith("-pdl-tiled"):
            # The prologue's scale chunk and STAGES steps' words, before the wait; in the loop, the later chunks'
            # scales, and per step x and its words, or for the first STAGES steps x alone in a branch of its own.
            tma = 1 + r["stages"] + 1 + (x_boxes + 1) * steps + min(steps, r["stages"]) * x_boxes
            packed = 1 + r["stages"] + 1 + steps  # (the scales' and words' loads)
            # The loader waits and triggers, on each of the two paths LLVM makes of its prologue (a program with
            # steps or none), and the MMA warps wait before they store out, the partials and the tickets (which no
            # loader wait orders in a program with no steps): 3 waits, 2 triggers (triton 3.6 and 3.9).
            assert (r["gdc_wait"], r["gdc_launch"]) == (3, 2), (name, r)
        else:
            tma = 1 + (1 + x_boxes) * steps
            packed = 1 + steps
            assert (r["gdc_wait"], r["gdc_launch"]) == (0, 0), (name, r)
        assert r["wgmma"] == wgmmas and r["tma"] == tma, (name, r)
        # int4-tiled's words and scales come in 4-D boxes (wgmma_common.packed_desc), the row-major ones in 2-D
        assert r["tma4d"] == (packed if name.endswith("-tiled") else 0), (name, r)
        # Timeline stamps only when built with them: entry (global timer and cycles), the loader's first issue,
        # first data, loop end, exit (cycles and global timer).
        assert r["timers"] == (7 if name.endswith("-stamps") else 0), (name, r)


def _run_pair_asm(word: int, byte: int, scale_bits: int) -> tuple[int, int]:
    """wgmma_int4._PAIR_ASM's text run for one word, byte t and bf16 scale; the bf16 bit patterns of $0 and $1."""
    regs = run_ptx(kernels.wgmma_int4._PAIR_ASM.value, {"$2": word, "$3": byte | (byte + 4) << 8, "$4": scale_bits})
    return regs["$0"], regs["$1"]


def test_pair_decode_text_matches_the_int4_format():
    """Lane t of a quad decodes byte t of each word into values 2t (low half) and 2t + 1 (high half) of the word,
    which is where the wgmma operand layout wants them; the values are the int4 format's own dequantization, bit
    for bit, for every byte, nibble and a range of scales (the kernel runs only on a GPU; its decode text runs here)."""
    for word, scale in zip(*int4_decode_cases((24,))):
        want = int4_decoded_bits(word, scale)  # values 0..7 of the word, (nibble - 8) * scale
        scale_bits = scale.view(torch.int16).item() & 0xFFFF
        for t in range(4):
            lo, hi = _run_pair_asm(word.item() & 0xFFFFFFFF, t, scale_bits)
            assert (lo, hi) == (want[2 * t].item(), want[2 * t + 1].item()), (hex(word.item()), t)


def _paired(word: int) -> int:
    """A row-major word (value j in nibble j) in int4-tiled's nibble order: value j in nibble j // 2 + 4 (j % 2)."""
    return sum(((word >> 4 * j) & 0xF) << 4 * (j // 2 + 4 * (j % 2)) for j in range(8))


def test_tiled_pair_decode_text_matches_the_int4_format():
    """_TILED_PAIR_ASM with the shift 4t: lane t decodes values 2t and 2t + 1 of an int4-tiled word, bit for bit the
    int4 format's values of the row-major word it was made from."""
    for word, scale in zip(*int4_decode_cases((24,))):
        want = int4_decoded_bits(word, scale)
        scale_bits = scale.view(torch.int16).item() & 0xFFFF
        for t in range(4):
            regs = run_ptx(kernels.wgmma_int4._TILED_PAIR_ASM.value,
                           {"$2": _paired(word.item() & 0xFFFFFFFF), "$3": 4 * t, "$4": scale_bits})
            assert (regs["$0"], regs["$1"]) == (want[2 * t].item(), want[2 * t + 1].item()), (hex(word.item()), t)


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


# wgmma_int4.TRAIN as shipped (two independent MMA warpgroups), as one partition, and as one without halves (the
# only training tile that splits K).
TRAIN_VARIANTS = ["two-parts", "one-part", "one-part-no-halves"]


def _train_tile(variant: str):
    from orbit_lightning.kernels import wgmma_int4 as wg

    changes = {"two-parts": dict(parts=2), "one-part": dict(parts=1), "one-part-no-halves": dict(parts=1, halves=False)}
    return dataclasses.replace(wg.TRAIN, **changes[variant])


def _spy(monkeypatch) -> list:
    """Record each launch of the wgmma kernel by dense_gemm, which sends it 9-16 rows of every weight here (the mma
    GEMV serves small and shorter-than-16384-row weights as shipped: configs.MMA_SMALL_WEIGHT, MMA_WIDE_MAX_N)."""
    gemm = sys.modules["orbit_lightning.kernels.gemm"]
    monkeypatch.setattr(gemm.configs, "MMA_SMALL_WEIGHT", 0)
    monkeypatch.setattr(gemm.configs, "MMA_WIDE_MAX_N", 0)
    calls = []
    monkeypatch.setattr(gemm, "wgmma_int4", lambda x, *a, _f=gemm.wgmma_int4: calls.append(x.shape) or _f(x, *a))
    return calls


# (format, N, K, M), with the K splits and steps per split an H200 (132 SMs) gives them (splits take whole scale
# chunks of 8 groups: 2 steps at group 32, 8 at 128): N off the 64-row tile, 5 splits of 1 chunk; 9 rows (group 128,
# 2 splits of 16 steps) and 16 (4 of 8) on 16-row tiles; a shorter last split (chunks 3, 3, 3, 2); no split and 32
# steps, so the 4-slot ring and the scale ring wrap (N = 17408 alone fills the GPU); 2 splits of 4 steps; 48 of 2;
# group 128 with 2 splits of 8 steps, 4 of 8 at 64 rows (where keeping a wgmma in flight returned NaNs), 4 of 8 at 32
# activation rows per tile, and no split of 5 chunks at 16 and 64 rows (the scale ring wraps at group 128).
CASES = [("int4", 200, 1280, 17), ("int4-g128", 6144, 4096, 9), ("int4", 4096, 4096, 16), ("int4", 4096, 2816, 16),
         ("int4", 17408, 4096, 32), ("int4", 8192, 1024, 64), ("int4", 192, 12288, 33), ("int4-g128", 320, 2048, 48),
         ("int4-g128", 4096, 4096, 64), ("int4-g128", 1024, 4096, 17), ("int4-g128", 16896, 5120, 16),
         ("int4-g128", 16896, 5120, 64),
         # int4-tiled (past 16 rows: below, the mma GEMV takes it): N off the tile, the rings wrapping, group 128
         ("int4-tiled", 208, 1280, 17), ("int4-tiled", 17408, 4096, 32), ("int4-tiled", 192, 12288, 33),
         ("int4-g128-tiled", 4096, 4096, 64)]


@gpu
@pytest.mark.skipif(not _hopper(), reason="wgmma is Hopper's (sm_90)")
@pytest.mark.parametrize("fmt,n,k,m", CASES)
def test_against_fp64_where_dense_gemm_sends_it(fmt, n, k, m, monkeypatch):
    calls = _spy(monkeypatch)
    packed, w = random_weight(fmt, (n, k), seed=n + k, device="cuda")
    x = torch.randn(m, k, generator=torch.Generator("cuda").manual_seed(m), device="cuda").bfloat16()
    ref = x.double() @ w.T
    y = kernels.dequant_linear(x, fmt, packed)
    assert calls == [(m, k)]
    assert_within(y, ref, matmul_bound(x, w, ref, 2.0**-8))
    # Tighter, against the bf16 weights every kernel decodes (test_gpu.py holds them bit-exact): the products of bf16
    # values are exact in fp32, so only the fp32 sum (K * 2^-23 of sum |x||w|, allowing the tensor cores' truncating
    # adds) and the output's rounding (2^-8 relative) remain. A wrong group or step shows here long before above.
    wb = kernels.dequantize(fmt, packed).double()
    ref_b = x.double() @ wb.T
    assert_within(y, ref_b, 2.0**-8 * ref_b.abs() + k * 2.0**-23 * (x.double().abs() @ wb.abs().T))
    # The split partials are summed in a fixed order: a second launch is bit-identical.
    assert torch.equal(kernels.dequant_linear(x, fmt, packed), y)
    if fmt.endswith("-tiled"):  # decoded into the operand places of the row-major words: the row-major run's bits
        assert torch.equal(kernels.dequant_linear(x, *row_major(fmt, packed)), y)


@gpu
@pytest.mark.skipif(not _hopper(), reason="wgmma is Hopper's (sm_90)")
@pytest.mark.parametrize("fmt", ["int4", "int4-g128", "int4-tiled", "int4-g128-tiled"])
def test_one_hot_rows_read_back_the_decoded_weights_bit_exactly(fmt, monkeypatch):
    """Row m of x is one-hot at k_m, so out[m, :] must be W[:, k_m] as decoded to bf16, bit for bit: one exact product,
    zeros elsewhere. The 64 positions (67 apart) cover every lane of a quad (k mod 8), both words of a k16 slice, every
    step and split of K = 4096, so every group of 128 and every group's place in its scale chunk (half the groups of
    32)."""
    calls = _spy(monkeypatch)
    n, k, m = 4096, 4096, 64
    packed, _ = random_weight(fmt, (n, k), seed=11, device="cuda")
    cols = (torch.arange(m, device="cuda") * 67 + 5) % k
    x = torch.zeros(m, k, device="cuda", dtype=torch.bfloat16)
    x[torch.arange(m, device="cuda"), cols] = 1.0
    y = kernels.dequant_linear(x, fmt, packed)
    assert calls == [(m, k)]
    assert torch.equal(y, kernels.dequantize(fmt, packed)[:, cols].T)


@gpu
@pytest.mark.skipif(not _hopper(), reason="wgmma is Hopper's (sm_90)")
@pytest.mark.parametrize("m", [9, 16, 40])
def test_decode_rows_with_lora_meet_the_oracle_and_repeat_bitwise(m, monkeypatch):
    """What ships for 9-64 decode rows with adapters: the kernel, then lora_add_many on each adapter's columns (three
    adapters over a fused q/k/v), against test_gemv_lora's fp64 oracle and its 2^-7 bound, on rows strided by more
    than K (a view into wider activations), bitwise the same on a second launch."""
    from orbit_lightning.kernels.gemv_lora import LoraDelta

    from tests.kernels.test_gemv_lora import _adapters, _oracle

    calls = _spy(monkeypatch)
    n, k, ns = 6144, 4096, (4096, 1024, 1024)
    packed, w = random_weight("int4", (n, k), seed=12, device="cuda")
    d = _adapters(ns, k, 16, torch.bfloat16)
    delta = LoraDelta([t.cuda() for t in d.a], [t.cuda() for t in d.b], d.scale)
    wide = torch.randn(m, k + 64, generator=torch.Generator("cuda").manual_seed(m), device="cuda").bfloat16()
    x = wide[:, 32 : 32 + k]  # 16-byte aligned rows, K + 64 apart
    y = kernels.dequant_linear(x, "int4", packed, lora=delta)
    assert calls == [(m, k)]
    assert torch.equal(kernels.dequant_linear(x, "int4", packed, lora=delta), y)
    ref, mag = _oracle(x.double().cpu(), w.cpu(), d)
    assert_within(y.cpu(), ref, 2.0**-7 * (mag + ref.abs()))


@gpu
@pytest.mark.skipif(not _hopper(), reason="wgmma is Hopper's (sm_90)")
@pytest.mark.parametrize("fmt", ["int4", "int4-g128"])
def test_pdl_launches_give_the_bits_of_plain_ones(fmt, monkeypatch):
    """Launched with PDL the kernel issues its first weight loads before it waits for the kernel before it, which
    writes its x. Chained after itself (K split: the next launch reuses the tickets the last one resets) and after
    rms_norm (which lets its dependents launch as it starts), eagerly and in a CUDA graph, every output is the bits
    the chain gives with PDL off: an early read of x or of the tickets would change them. (Back-to-back replays of a
    whole decode layer: tests/bench/test_decode_chain.py.)"""
    from orbit_lightning.kernels import pdl

    assert sys.modules["orbit_lightning.kernels.wgmma_int4"].PDL_LAUNCH  # (as shipped)
    calls = _spy(monkeypatch)
    n = k = 4096
    m = 16  # (4 K splits on an H200)
    packed, _ = random_weight(fmt, (n, k), seed=5, device="cuda")
    gen = torch.Generator("cuda").manual_seed(5)
    norm_w = torch.rand(k, generator=gen, device="cuda").bfloat16() + 0.5
    x0 = torch.randn(m, k, generator=gen, device="cuda").bfloat16()

    def chain(x):
        outs = []
        for _ in range(4):
            x = kernels.dequant_linear(kernels.dequant_linear(x, fmt, packed), fmt, packed)
            outs.append(x)
            x = kernels.rms_norm(x, norm_w)
        return torch.stack(outs)

    runs = []
    for enabled in (False, True):
        monkeypatch.setattr(pdl, "ENABLED", enabled)
        assert pdl.use_pdl(x0.device) == enabled
        eager = chain(x0)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = chain(x0)
        graph.replay()
        torch.cuda.synchronize()
        runs += [eager, replayed.clone()]
    assert len(calls) == 4 * 8 and all(shape == (m, k) for shape in calls)
    assert runs[0].isfinite().all()
    for run in runs[1:]:
        assert torch.equal(run, runs[0])


@gpu
@pytest.mark.skipif(not _hopper(), reason="wgmma is Hopper's (sm_90)")
def test_other_rows_layouts_and_modes_keep_their_kernels(monkeypatch):
    """8 rows (a decode GEMV), one past MAX_ROWS (the tile kernel), fp16 activations, rows off TMA's 16-byte alignment,
    K not in whole scale chunks (1536 of group 128: DeepSeek-V3's q_b), the switch off and batch-invariant mode do not
    reach it, and still meet the bound."""
    from orbit_lightning.kernels.wgmma_int4 import MAX_ROWS

    calls = _spy(monkeypatch)
    packed, w = random_weight("int4", (256, 1024), seed=7, device="cuda")
    x = torch.randn(MAX_ROWS + 1, 1032, generator=torch.Generator("cuda").manual_seed(8), device="cuda").bfloat16()
    cases = [x[:8, :1024], x[:, :1024], x[:32, :1024].half(), x[:32, 1:1025]]
    for xs in cases:
        ref = xs.double() @ w.T
        assert_within(kernels.dequant_linear(xs, "int4", packed), ref, matmul_bound(xs, w, ref, 2.0**-8))
    packed_q, w_q = random_weight("int4-g128", (256, 1536), seed=9, device="cuda")
    xq = torch.randn(32, 1536, generator=torch.Generator("cuda").manual_seed(9), device="cuda").bfloat16()
    ref = xq.double() @ w_q.T
    assert_within(kernels.dequant_linear(xq, "int4-g128", packed_q), ref, matmul_bound(xq, w_q, ref, 2.0**-8))
    with kernels.batch_invariant():
        kernels.dequant_linear(x[:32, :1024], "int4", packed)
    monkeypatch.setattr(kernels.configs, "WGMMA_INT4", False)
    kernels.dequant_linear(x[:32, :1024], "int4", packed)
    assert calls == []


@gpu
@pytest.mark.skipif(not _hopper(), reason="wgmma is Hopper's (sm_90)")
def test_tall_tiled_weights_take_the_mma_gemv_at_16_rows_unless_switched(monkeypatch):
    """At 16 rows a tall weight (N = 17408) in int4 goes to wgmma_int4; in int4-tiled to the mma GEMV
    (configs.MMA_TILED_ALL_N), or with the switch off to wgmma_int4 on the tiled words, and both meet the bound."""
    calls = _spy(monkeypatch)
    n, k, m = 17408, 4096, 16
    packed, w = random_weight("int4-tiled", (n, k), seed=13, device="cuda")
    x = torch.randn(m, k, generator=torch.Generator("cuda").manual_seed(13), device="cuda").bfloat16()
    ref = x.double() @ w.T
    assert_within(kernels.dequant_linear(x, *row_major("int4-tiled", packed)), ref, matmul_bound(x, w, ref, 2.0**-8))
    assert calls == [(m, k)]
    assert_within(kernels.dequant_linear(x, "int4-tiled", packed), ref, matmul_bound(x, w, ref, 2.0**-8))
    assert calls == [(m, k)]  # (the mma GEMV: no second wgmma call)
    monkeypatch.setattr(kernels.configs, "MMA_TILED_ALL_N", False)
    assert_within(kernels.dequant_linear(x, "int4-tiled", packed), ref, matmul_bound(x, w, ref, 2.0**-8))
    assert calls == [(m, k)] * 2


def _bf16_weight_bound(x: torch.Tensor, wb: torch.Tensor, ref_b: torch.Tensor) -> torch.Tensor:
    """test_against_fp64_where_dense_gemm_sends_it's tight bound against the decoded bf16 weights wb [.., N, K]."""
    return 2.0**-8 * ref_b.abs() + x.shape[-1] * 2.0**-23 * (x.double().abs() @ wb.abs().transpose(-1, -2))


@gpu
@pytest.mark.skipif(not _hopper(), reason="wgmma is Hopper's (sm_90)")
@pytest.mark.parametrize("variant", TRAIN_VARIANTS)
def test_training_tile_covers_many_row_tiles(variant):
    """wgmma_int4.TRAIN (two warpgroups, 256 activation rows per program; as shipped, as one partition, and without
    halves) on M = 600 (three row tiles, the last partial) and N = 320 (a partial 128-row weight tile): every output
    meets the bound against the bf16 weights, and nothing past M or N is written."""
    from orbit_lightning.kernels import wgmma_int4 as wg
    from orbit_lightning.kernels.formats import resolve
    from orbit_lightning.kernels.gemm import _tickets

    m, n, k = 600, 320, 2048
    packed, _ = random_weight("int4", (n, k), seed=21, device="cuda")
    x = torch.randn(m, k, generator=torch.Generator("cuda").manual_seed(21), device="cuda").bfloat16()
    out = torch.full((m + 8, n + 8), float("nan"), device="cuda", dtype=torch.bfloat16)
    # 3 x 3 tiles on 132 SMs: without halves K splits in 8 (whole scale chunks), partials summed per tile.
    tile = _train_tile(variant)
    y = wg.wgmma_int4(x, resolve("int4", packed, stacked=False), out[:m, :n], lambda c: _tickets(x.device, c), tile)
    wb = kernels.dequantize("int4", packed).double()
    ref_b = x.double() @ wb.T
    assert_within(y, ref_b, _bf16_weight_bound(x, wb, ref_b))
    assert out[m:].isnan().all() and out[:, n:].isnan().all()


@gpu
@pytest.mark.skipif(not _hopper(), reason="wgmma is Hopper's (sm_90)")
@pytest.mark.parametrize("variant", TRAIN_VARIANTS)
@pytest.mark.parametrize("fmt", ["int4", "int4-tiled"])
def test_grouped_training_tile_meets_each_experts_reference(variant, fmt):
    """wgmma_int4_grouped on 8 experts whose row counts are uneven: empty experts (first, middle, last), one row, a
    count just past a 256-row tile and several tiles: each expert's rows meet the bound against x_e @ W_e^T of its
    decoded bf16 weights, through device offsets alone, and every row is written."""
    from orbit_lightning.kernels import wgmma_int4 as wg

    counts = [0, 1, 257, 0, 40, 600, 3, 0]
    n, k = 384, 1024
    packed, w, x, offsets = uneven_int4_experts(counts, n, k, k, seed=22, fmt=fmt)
    t = sum(counts)
    assert wg.supports_grouped(x, w)
    out = torch.full((t, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    wg.wgmma_int4_grouped(x, offsets, w, out, _train_tile(variant))
    wb = kernels.dequantize(fmt, packed).double()  # [E, N, K]
    for i, (lo, hi) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        ref_b = x[lo:hi].double() @ wb[i].T
        assert_within(out[lo:hi], ref_b, _bf16_weight_bound(x[lo:hi], wb[i], ref_b))
    # A chunk of experts in any order, by id (the host-sized chunks of the training path): groups 0..2 are experts
    # 5, 2 and 4 with their row counts; the output equals the same experts' rows above, bit for bit.
    chunk = torch.tensor([5, 2, 4], dtype=torch.int32, device="cuda")
    rows = [x[offsets[e] : offsets[e + 1]] for e in chunk.tolist()]
    chunk_offsets = expert_offsets([len(r) for r in rows], device="cuda")
    out_chunk = torch.full((int(chunk_offsets[-1]), n), float("nan"), device="cuda", dtype=torch.bfloat16)
    wg.wgmma_int4_grouped(torch.cat(rows), chunk_offsets, w, out_chunk, _train_tile(variant),
                          ids=chunk)
    assert torch.equal(out_chunk, torch.cat([out[offsets[e] : offsets[e + 1]] for e in chunk.tolist()]))


def test_row_counts_past_the_decode_tile_take_the_widest_tile_that_fills_the_gpu():
    """pick_tile: the decode tile to 64 rows; past it the widest of WIDE_TILES whose row tile the rows fill and whose
    grid gives WIDE_PROGRAMS_PER_SM programs per SM; else 64-row tiles (which split K). Every tile past the decode
    tile steps a whole group of 32 per K step; only those stepping 128 of K take group 128 (supports)."""
    from orbit_lightning.kernels import wgmma_int4 as wg

    sms = 132
    assert wg.pick_tile(wg.MIN_ROWS, 4096, sms) is wg.DECODE and wg.pick_tile(64, 4096, sms) is wg.DECODE
    # Qwen3-8B gate_up (N = 24576): 192 weight tiles of 128 rows fill the GPU from 65 rows (WIDE), 256-row tiles
    # from 129 (TRAIN); its o projection (N = 4096): 32 weight tiles, 64 with two row tiles: 64-row tiles (ROWS) to 256
    # rows, WIDE from 257 (four row tiles, 128 programs), TRAIN never below 512 (two, 64).
    assert [wg.pick_tile(m, 24576, sms) for m in (65, 128, 129, 512)] == [wg.WIDE, wg.WIDE, wg.TRAIN, wg.TRAIN]
    assert [wg.pick_tile(m, 4096, sms) for m in (65, 256, 257, 512)] == [wg.ROWS, wg.ROWS, wg.WIDE, wg.WIDE]
    for tile in (wg.ROWS, *wg.WIDE_TILES):
        assert tile.bm >= 64 and tile.bk % 32 == 0


# Rows past the decode tile (wgmma_int4.pick_tile): (format, N, K, M). On 64-row tiles (ROWS): the smallest count past
# 64 on a partial row tile with N off the weight tile and K in 5 scale chunks, four row tiles, 256 rows, N off the
# 128-row tile, group 128; on WIDE (tall matrices): a partial second half; on TRAIN: two row tiles, the second partial,
# twice; the most rows (WIDE, four row tiles).
MID_CASES = [("int4", 320, 1280, 65), ("int4", 4096, 4096, 200), ("int4", 2048, 4096, 256), ("int4", 200, 2048, 257),
             ("int4-g128", 4096, 1024, 100), ("int4", 24576, 1024, 100), ("int4", 24576, 2048, 300),
             ("int4", 9216, 4096, 500), ("int4", 4096, 2048, 512),
             ("int4-tiled", 4096, 4096, 200), ("int4-tiled", 24576, 2048, 300), ("int4-tiled", 9216, 4096, 500)]


@gpu
@pytest.mark.skipif(not _hopper(), reason="wgmma is Hopper's (sm_90)")
@pytest.mark.parametrize("fmt,n,k,m", MID_CASES)
def test_rows_past_the_decode_tile_meet_the_bf16_weights_bound(fmt, n, k, m, monkeypatch):
    """What the model's matmul (quant.dispatch.dequant_matmul, through kernels.prefill_linear) runs for 65 to MAX_ROWS
    rows: the kernel at pick_tile's tile, within the bound against the decoded bf16 weights, bitwise on repeat (the
    split partials are summed in a fixed order); nothing past M or N is written."""
    from orbit_lightning.kernels import wgmma_int4 as wg
    from orbit_lightning.kernels.gemm import _tickets

    from orbit_lightning.quant.dispatch import dequant_matmul
    from orbit_lightning.quant.linear import QuantLinear

    assert 64 < m <= wg.MAX_ROWS
    calls = _spy(monkeypatch)
    layer = QuantLinear(k, n, fmt, dtype=torch.bfloat16).cuda()
    layer.random_init(torch.Generator("cuda").manual_seed(n + m))
    x = torch.randn(m, k, generator=torch.Generator("cuda").manual_seed(m), device="cuda").bfloat16()
    with torch.no_grad():
        y = dequant_matmul(x, layer)
        assert torch.equal(dequant_matmul(x, layer), y)
    assert calls == [(m, k)] * 2
    wb = layer.dequantize(torch.bfloat16).double()
    ref_b = x.double() @ wb.T
    assert_within(y, ref_b, _bf16_weight_bound(x, wb, ref_b))
    out = torch.full((m + 8, n + 8), float("nan"), device="cuda", dtype=torch.bfloat16)
    pw = kernels.formats.resolve(fmt, layer.packed(), stacked=False)
    wg.wgmma_int4(x, pw, out[:m, :n], lambda c: _tickets(x.device, c))
    assert torch.equal(out[:m, :n], y) and out[m:].isnan().all() and out[:, n:].isnan().all()


@gpu
@pytest.mark.skipif(not _hopper(), reason="wgmma is Hopper's (sm_90)")
def test_rows_the_kernel_does_not_take_dequantize_for_cublas(monkeypatch):
    """Past MAX_ROWS, group 128 on the wide tiles (they step 64 of K, under a group), fp16 activations and
    batch-invariant mode: the model's matmul keeps its other paths and still meets the fp64 bound."""
    from orbit_lightning.kernels import wgmma_int4 as wg

    from orbit_lightning.quant.dispatch import dequant_matmul
    from orbit_lightning.quant.linear import QuantLinear

    calls = _spy(monkeypatch)
    gen = torch.Generator("cuda").manual_seed(3)
    for fmt, n, m, dtype in (("int4", 256, wg.MAX_ROWS + 1, torch.bfloat16), ("int4-g128", 24576, 100, torch.bfloat16),
                             ("int4", 256, 100, torch.float16)):
        assert fmt == "int4" or wg.pick_tile(m, n, 132).bk < 128  # (WIDE: 64 of K per step)
        layer = QuantLinear(1024, n, fmt, dtype=dtype).cuda()
        layer.random_init(gen)
        x = torch.randn(m, 1024, generator=gen, device="cuda").to(dtype)
        w = layer.dequantize(torch.float64)
        ref = x.double() @ w.T
        with torch.no_grad():
            assert_within(dequant_matmul(x, layer), ref, matmul_bound(x, w, ref, 2.0**-8))
    layer = QuantLinear(1024, 256, "int4").cuda()
    layer.random_init(gen)
    with kernels.batch_invariant(), torch.no_grad():
        dequant_matmul(torch.randn(100, 1024, generator=gen, device="cuda").bfloat16(), layer)
    assert calls == []


def test_a_stamp_buffer_the_kernel_would_overrun_is_refused():
    """The timeline stamps are written unchecked by the kernel, so the host refuses what it would overrun."""
    from orbit_lightning.kernels.timeline import SLOTS, check_stamps

    check_stamps(torch.zeros(5, SLOTS, dtype=torch.int64), 5, torch.device("cpu"))  # (exactly one row per program)
    for bad in (torch.zeros(4, SLOTS, dtype=torch.int64), torch.zeros(5, SLOTS, dtype=torch.int32),
                torch.zeros(SLOTS, 5, dtype=torch.int64).T):
        with pytest.raises(ValueError, match=r"stamps: need a contiguous int64 tensor of at least \[5, 8\]"):
            check_stamps(bad, 5, torch.device("cpu"))


def test_a_k_split_target_of_zero_fills_one_wave_of_resident_programs():
    """programs_per_sm = 0: the K splits give as many programs as the SMs hold at once, never a second wave. Programs
    per SM follow from sm_90's 64k registers (launch cap x the MMA warps and a loader warpgroup) and 228 KB of shared
    memory (the rings at 64 rows take 84 KB)."""
    from orbit_lightning.kernels import wgmma_int4 as wg

    wave = dataclasses.replace(wg.DECODE, programs_per_sm=0)
    with pytest.raises(ValueError, match="Tile.programs_per_sm=-1"):
        dataclasses.replace(wg.DECODE, programs_per_sm=-1)
    assert [wg.resident_programs(wave, bm, 32) for bm in (16, 32, 64)] == [3, 3, 2]  # 256 x 80 regs; smem
    assert wg.resident_programs(dataclasses.replace(wave, regs=64), 16, 32) == 4
    assert wg.resident_programs(wg.TRAIN, 256, 32) == 1  # (384 threads x 168 registers)
    sms = 132
    for n in (192, 2048, 4096, 6144, 9216, 24576):
        for k in (1024, 4096, 12288):
            for m in (9, 16, 33, 64):
                bm = max(16, 1 << (m - 1).bit_length())
                tiles = -(-n // 64)
                k_per_split, splits = wg.split_k(k, 32, tiles, wave, sms, bm)
                assert k_per_split * splits >= k > k_per_split * (splits - 1) and k_per_split % 256 == 0
                assert tiles * splits <= max(tiles, wg.resident_programs(wave, bm, 32) * sms), (n, k, m, splits)


@gpu
@pytest.mark.skipif(not _hopper(), reason="wgmma is Hopper's (sm_90)")
def test_timeline_stamps_every_program_in_causal_order_and_change_no_result():
    """bench/wgmma_timeline.py's build: with stamps on, the result is bitwise the kernel's without them, and every
    program's cycle stamps are in the order the work forces (entry, the loader's first issue, that step's data, the
    last wgmma, exit; the loader and the MMA warps read one SM counter), on an SM that exists."""
    from orbit_lightning.kernels import wgmma_int4 as wg
    from orbit_lightning.kernels.formats import resolve
    from orbit_lightning.kernels.gemm import _tickets
    from orbit_lightning.kernels.timeline import CYCLES, ENTRY_NS, EXIT_NS, SLOTS, SM_ID

    n, k, m = 4096, 4096, 16
    packed, _ = random_weight("int4", (n, k), seed=5, device="cuda")
    pw = resolve("int4", packed, stacked=False)
    x = torch.randn(m, k, generator=torch.Generator("cuda").manual_seed(3), device="cuda").bfloat16()
    tile = wg.pick_tile(m, n, torch.cuda.get_device_properties(0).multi_processor_count)
    _, splits = wg.split_k(k, pw.group, n // 64, tile, torch.cuda.get_device_properties(0).multi_processor_count, 16)
    stamps = torch.zeros(n // 64 * splits, SLOTS, dtype=torch.int64, device="cuda")

    def run(st):
        return wg.wgmma_int4(x, pw, torch.empty(m, n, dtype=torch.bfloat16, device="cuda"),
                             lambda c: _tickets(x.device, c), stamps=st)

    assert torch.equal(run(stamps), run(None))
    rows = stamps.cpu()
    order = [CYCLES, wg.FIRST_ISSUE.value, wg.FIRST_DATA.value, wg.LOOP_END.value, wg.EXIT_CYCLES.value]
    assert (rows[:, ENTRY_NS] > 0).all() and (rows[:, EXIT_NS] >= rows[:, ENTRY_NS]).all()
    for before, after in zip(order, order[1:]):
        assert (rows[:, after] >= rows[:, before]).all(), (before, after)
    assert rows[:, SM_ID].max().item() < torch.cuda.get_device_properties(0).multi_processor_count
