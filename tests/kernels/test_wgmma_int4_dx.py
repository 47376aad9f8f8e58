"""The warpgroup-MMA int4 dX (kernels/wgmma_int4_dx.py): it compiles for sm_90 on any machine (its hand-built layouts
assert themselves trivial in the compile), its row order is a permutation of the tile's columns, and on an H200 it
meets the fp64 oracle against the decoded bf16 weights, dense and grouped (by expert, or a chunk of experts by id), and
reads every weight bit-exactly (one-hot rows of dy)."""


import dataclasses

import pytest
import torch

from orbit_lightning import kernels
from tests.kernels.kernel_oracles import (
    assert_within,
    expert_offsets,
    gpu,
    random_weight,
    row_major,
    uneven_int4_experts,
)
from tests.kernels.sm90_compile import compile_report, needs_sm90_compiler

_SCRIPT = r"""
import dataclasses, inspect, json
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import mangle_type
from orbit_lightning.kernels import wgmma_int4 as wg, wgmma_int4_dx as dx
from orbit_lightning.kernels.wgmma_common import packed_desc, smem_layout

from tests.kernels.sm90_compile import ptxas_usage

names = list(inspect.signature(dx._wgmma_int4_dx_kernel.fn).parameters)
br = dx.BLOCK_R.value
report = {}
other_parts = dataclasses.replace(wg.TRAIN, parts=3 - wg.TRAIN.parts)  # (one partition of MMA warps, or two)
for tile, grouped, tiled in [(wg.TRAIN, False, False), (wg.TRAIN, True, False), (other_parts, False, False),
                             (other_parts, True, False), (wg.TRAIN, True, True), (other_parts, False, True)]:
    bn = 16 * tile.warps
    dy = torch.empty(4096, 4096, dtype=torch.bfloat16)
    words = torch.empty(4096, 512, dtype=torch.int32)
    scales = torch.empty(4096, 128, dtype=torch.bfloat16)
    def desc(t, block, dtype):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block,
                                gl.NVMMASharedLayout.get_default_for(block, dtype))
    w_box, s_box = [br, bn // 8 // tile.parts], [br, wg.SCALE_CHUNK.value]
    descs = {"dy_desc": desc(dy, [tile.bm, br], gl.bfloat16),
             "w_desc": packed_desc(words, w_box, "int32", 16, tiled),
             "s_desc": packed_desc(scales, s_box, "bf16", 8, tiled)}
    const = dict(GROUP=32, BN=bn, BM=tile.bm, STAGES=tile.stages, GROUPED=grouped, HAS_IDS=grouped, E_POW2=128,
                 PARTS=tile.parts, WORKER_REGS=wg.PART_REGS, TILED=tiled, W_SMEM=smem_layout(tuple(w_box), "int32"),
                 S_SMEM=smem_layout(tuple(s_box), "bf16"), num_warps=tile.warps // tile.parts)
    pointers = {"out_ptr": "*bf16", "offsets_ptr": "*i32", "ids_ptr": "*i32"}
    sig = {n: "constexpr" if n in const else mangle_type(descs[n]) if n in descs else pointers.get(n, "i32")
           for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]]
             for n in ("out_ptr", "offsets_ptr", "ids_ptr", "stride_om", "K", "N")}
    src = GluonASTSource(fn=dx._wgmma_int4_dx_kernel, signature=sig, attrs=attrs,
                         constexprs={(names.index(k),): v for k, v in const.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=tile.warps // tile.parts, maxnreg=tile.regs))
    ptx = compiled.asm["ptx"]
    report[f"parts{tile.parts}-grouped{int(grouped)}" + ("-tiled" if tiled else "")] = {
        "parts": tile.parts, "spills": ptxas_usage(ptx)["spills"], "wgmma": ptx.count("wgmma.mma_async"),
        "tma": ptx.count("cp.async.bulk.tensor"), "tma4d": ptx.count("cp.async.bulk.tensor.4d"),
        "prmt": ptx.count("prmt")}
print(json.dumps(report))
"""


@needs_sm90_compiler
def test_compiles_for_sm90_with_trivial_layouts_and_no_spills():
    """Dense and grouped, with the MMA warps as one partition or two, compile (a layout step that is not trivial
    fails it) without spills; per step of 64 of N and MMA partition: 4 k16 wgmmas per half of the activation rows, a
    TMA load of its words (and dy and the scales for all), and one prmt per pair of W's rows and lane (the step's 32
    values per thread come from 8 of them)."""
    report = compile_report(_SCRIPT)
    assert set(report) == {f"parts{p}-grouped{g}" for p in (1, 2) for g in (0, 1)} | {"parts2-grouped1-tiled",
                                                                                     "parts1-grouped0-tiled"}
    for name, r in report.items():
        p = r["parts"]
        assert not r["spills"] and r["wgmma"] == 8 * p and r["tma"] == 2 + p and r["prmt"] == 8 * p, (name, r)
        # int4-tiled's words and scales in 4-D boxes (wgmma_common.packed_desc)
        assert r["tma4d"] == ((1 + p) if name.endswith("-tiled") else 0), (name, r)


@pytest.mark.parametrize("tiled", [False, True], ids=["row-major", "tiled"])
def test_pair_decode_text_matches_the_int4_format(tiled):
    """_DX_ASM for lane nibble j of a word column: from the words of W's rows n and n + 1, ($0, $1) are the two rows'
    values j and ($2, $3) values j + 4, each times its own row's scale: the int4 format's dequantization, bit for bit,
    for every j, nibble value and a range of scales (its text runs here; the kernel only on a GPU). Tiled: the words
    in int4-tiled's nibble order (value v in nibble v // 2 + 4 (v % 2)), the selector and shift dx_selector's."""
    from orbit_lightning.kernels import wgmma_int4_dx as wdx

    from tests.kernels.ptx_text import int4_decode_cases, int4_decoded_bits, run_ptx

    bits = lambda t: t.view(torch.int16).int() & 0xFFFF  # noqa: E731

    def stored(word: int) -> int:  # (value v in nibble v // 2 + 4 (v % 2) where tiled)
        return sum(((word >> 4 * v) & 0xF) << 4 * (v // 2 + 4 * (v % 2)) for v in range(8)) if tiled else word

    for pair, scale in zip(*int4_decode_cases((12, 2))):  # (pair 0: every nibble value in each row)
        want = [int4_decoded_bits(pair[r], scale[r]) for r in (0, 1)]
        for j in range(4):
            # the kernel's selector and shift for lane j: the bytes holding values j and j + 4 (nibbles a, a + 2 /
            # a + 4 of the stored word), and the half of the byte they are in
            a = j // 2 + 4 * (j % 2) if tiled else j
            lo, hi = a // 2, (a + (2 if tiled else 4)) // 2
            regs = run_ptx(wdx._DX_ASM.value, {
                "$4": stored(pair[0].item() & 0xFFFFFFFF), "$5": stored(pair[1].item() & 0xFFFFFFFF),
                "$6": lo | hi << 4 | (lo + 4) << 8 | (hi + 4) << 12, "$7": 4 * (a % 2),
                "$8": bits(scale[0]).item(), "$9": bits(scale[1]).item()})
            got = [regs[f"${i}"] for i in range(4)]
            expect = [want[0][j], want[1][j], want[0][j + 4], want[1][j + 4]]
            assert got == [v.item() for v in expect], (hex(pair[0].item()), hex(pair[1].item()), j)


def test_row_order_is_a_permutation_of_the_tile_columns():
    """row_column (the epilogue's ROW_PERM) maps the 128 accumulator rows onto the tile's 128 columns of K one to
    one, keeps 4 consecutive rows on 4 consecutive columns, and gives lane g's rows g and g + 8 of each warp's 16 the
    nibbles j and j + 4 of one word column (the pair one prmt gathers)."""
    from orbit_lightning.kernels.wgmma_int4_dx import row_column

    cols = [row_column(r) for r in range(128)]
    assert sorted(cols) == list(range(128))
    assert all(cols[r + i] == cols[r] + i for r in range(0, 128, 4) for i in range(4))
    for r in range(128):
        if r % 16 < 8:
            assert cols[r] // 8 == cols[r + 8] // 8 and cols[r + 8] == cols[r] + 4


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _bound(dy: torch.Tensor, wb: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """One rounding of the output (2^-8 relative) and the fp32 sum (N * 2^-23 of sum |dy||w|, allowing the tensor
    cores' truncating adds): the products of bf16 values are exact in fp32."""
    return 2.0**-8 * ref.abs() + dy.shape[-1] * 2.0**-23 * (dy.double().abs() @ wb.abs())


def _tile(parts: int):
    """wgmma_int4.TRAIN with its MMA warps as one partition or as two independent warpgroups."""
    from orbit_lightning.kernels import wgmma_int4 as wg

    return dataclasses.replace(wg.TRAIN, parts=parts)


@gpu
@pytest.mark.skipif(not _hopper(), reason="wgmma is Hopper's (sm_90)")
@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("fmt", ["int4", "int4-tiled"])
def test_dense_dx_meets_the_bf16_weight_oracle(parts, fmt):
    """T = 600 (three row tiles, the last short: its second half skipped), N = 320 (the last step of 64 reads past N:
    zeros from dy), K = 1280 (ten 128-column tiles, the odd ones on the upper half of their scale box): every output
    within the bound, nothing past T or K written."""
    from orbit_lightning.kernels import wgmma_int4_dx as wdx
    from orbit_lightning.kernels.formats import resolve

    t, n, k = 600, 320, 1280
    packed, _ = random_weight(fmt, (n, k), seed=31, device="cuda")
    w = resolve(fmt, packed, stacked=False)
    dy = torch.randn(t, n, generator=torch.Generator("cuda").manual_seed(31), device="cuda").bfloat16()
    assert wdx.supports_dx(dy, w)
    out = torch.full((t + 8, k + 8), float("nan"), device="cuda", dtype=torch.bfloat16)
    wdx.wgmma_int4_dx(dy, w, out[:t, :k], tile=_tile(parts))
    wb = kernels.dequantize(fmt, packed).double()
    ref = dy.double() @ wb
    assert_within(out[:t, :k], ref, _bound(dy, wb, ref))
    assert out[t:].isnan().all() and out[:, k:].isnan().all()
    if w.tiled:  # decoded into the operand places of the row-major words: the row-major run's bits
        rows = resolve(*row_major(fmt, packed), stacked=False)
        assert torch.equal(wdx.wgmma_int4_dx(dy, rows, torch.empty_like(out[:t, :k]), tile=_tile(parts)),
                           out[:t, :k])  # fmt: skip


@gpu
@pytest.mark.skipif(not _hopper(), reason="wgmma is Hopper's (sm_90)")
@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("fmt", ["int4", "int4-tiled"])
def test_grouped_dx_meets_each_experts_oracle_and_reads_weights_exactly(parts, fmt):
    """8 experts with empty ones, one row and several tiles: dy_e @ W_e within the bound per expert; a chunk of experts
    by id gives the same rows bit for bit; and one-hot rows of dy read W_e[n, :] back exactly (every word column,
    nibble and scale group of the tile's row order)."""
    from orbit_lightning.kernels import wgmma_int4_dx as wdx

    counts = [0, 1, 300, 0, 40, 520, 3, 0]
    n, k = 384, 1024
    packed, w, dy, offsets = uneven_int4_experts(counts, n, k, n, seed=32, fmt=fmt)
    t = sum(counts)
    out = torch.full((t, k), float("nan"), device="cuda", dtype=torch.bfloat16)
    wdx.wgmma_int4_dx(dy, w, out, offsets, tile=_tile(parts))
    wb = kernels.dequantize(fmt, packed).double()
    bounds = [(lo, hi) for lo, hi in zip(offsets[:-1].tolist(), offsets[1:].tolist())]
    for i, (lo, hi) in enumerate(bounds):
        ref = dy[lo:hi].double() @ wb[i]
        assert_within(out[lo:hi], ref, _bound(dy[lo:hi], wb[i], ref))
    chunk = torch.tensor([5, 2, 4], dtype=torch.int32, device="cuda")
    rows = [dy[bounds[c][0] : bounds[c][1]] for c in chunk.tolist()]
    chunk_offsets = expert_offsets([len(r) for r in rows], device="cuda")
    out_chunk = torch.empty(int(chunk_offsets[-1]), k, device="cuda", dtype=torch.bfloat16)
    wdx.wgmma_int4_dx(torch.cat(rows), w, out_chunk, chunk_offsets, chunk, _tile(parts))
    assert torch.equal(out_chunk, torch.cat([out[bounds[c][0] : bounds[c][1]] for c in chunk.tolist()]))
    # One-hot: expert 5's 520 rows pick rows n = 0, 7, 14, ... of W_5, so out row = W_5[n, :] in bf16, exactly.
    lo, hi = bounds[5]
    picks = (torch.arange(hi - lo, device="cuda") * 7) % n
    onehot = torch.zeros(t, n, device="cuda", dtype=torch.bfloat16)
    onehot[torch.arange(lo, hi, device="cuda"), picks] = 1.0
    wdx.wgmma_int4_dx(onehot, w, out, offsets, tile=_tile(parts))
    assert torch.equal(out[lo:hi], kernels.dequantize(fmt, packed)[5][picks])
