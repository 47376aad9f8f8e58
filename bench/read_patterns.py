"""Where the M = 1 mma GEMV's memory side loses against one streaming read: its loads, loop and grid with no
compute, in variants that change one thing each, on the 12 dense shapes of bench/kernels.py (H200, graph_us behind
the read flush, times in us; the kernels compute nothing useful, only the time means anything).

    python bench/read_patterns.py [--variants ship noscale s-v4 ...]

Every variant runs gemv_mma's grid (16 weight rows per program, the M = 1 config's warps splitting K, two K tiles a
step, the next step's loads in flight) and folds what it loads into one xor per lane; VARIANTS says what each
changes. Against: `read` (bench/kernels.py's floor: one streaming read of the words and scales) and `int4` (the
dispatched kernel) in the same run.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from orbit_lightning.kernels import configs, gemv_mma
from orbit_lightning.kernels.configs import sm_count

from orbit_lightning import kernels
from orbit_lightning.quant.formats import get_format

_spec = importlib.util.spec_from_file_location("bench_kernels", os.path.join(os.path.dirname(__file__), "kernels.py"))
bk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bk)

# name -> (SCALES, WORDS, X, ALLOC, SUM). SCALES: 0 none, 1 the shipped b16 per row per K tile, 2 one 16-byte load per
# row per step (every scale of the step; a lane would pick its two), 3 one b32 per row per step (the two groups of
# WORDS 1). WORDS: 0 the shipped mapping (lane t: 16 bytes at 16t of each 64-byte half of the step's 128-byte line),
# 1 a lane's 32 bytes adjacent (at 32t: its K run 64t..64t+63, two g32 groups), 2 each warp's bytes as one contiguous
# range (a layout repacked for it). X: the activations' loads as at M = 1 (row g = 0's lanes, 64 bytes a K tile).
# ALLOC: the word loads without L1::no_allocate. SUM: the program's warps' xors summed through shared memory.
VARIANTS = {
    "ship": (1, 0, 1, 0, 1),
    "ship-nox": (1, 0, 0, 0, 1),
    "noscale": (0, 0, 1, 0, 1),
    "s-v4": (2, 0, 1, 0, 1),
    "adj-s32": (3, 1, 1, 0, 1),
    "adj-s32-alloc": (3, 1, 1, 1, 1),
    "contig": (0, 2, 1, 0, 1),
    "contig-nosum": (0, 2, 1, 0, 0),
}


def _load_asm(n: int, hint: str, width: str = "v4.u32") -> str:
    """PTX: n loads of 16 bytes (or of one `width`) into registers from the n addresses after them, if the last
    operand is not 0."""
    regs = 4 * n if width == "v4.u32" else n
    text = "{\n.reg .pred p;\n" + f"setp.ne.b32 p, ${regs + n}, 0;\n"
    text += "".join(f"mov.b32 ${i}, 0;\n" for i in range(regs))
    for i in range(n):
        dst = f"{{${4 * i}, ${4 * i + 1}, ${4 * i + 2}, ${4 * i + 3}}}" if width == "v4.u32" else f"${i}"
        text += f"@p ld.global.nc{hint}.{width} {dst}, [${regs + i}];\n"
    return text + "}"


_W2 = tl.constexpr(_load_asm(2, ".L1::no_allocate.L2::128B"))
_W2_ALLOC = tl.constexpr(_load_asm(2, ".L2::128B"))
_S1 = tl.constexpr(_load_asm(1, ""))
_S32 = tl.constexpr(_load_asm(2, "", "b32"))
_S16 = tl.constexpr(_load_asm(2, "", "b16").replace("mov.b32", "mov.b16"))
# a lane's 64 bytes of activations: gemv_mma's own load lines (four 16-byte loads from one address), predicated here
# as the others (gemv_mma's loads no longer are)
_X16 = tl.constexpr(
    "{\n.reg .pred p;\nsetp.ne.b32 p, $17, 0;\n"
    + "".join(f"mov.b32 ${i}, 0;\n" for i in range(16))
    + "".join(f"@p {line}\n" for line in gemv_mma._LOAD_X.value.splitlines() if line.startswith("ld.global"))
    + "}"
)


@triton.jit
def _ld(TEXT: tl.constexpr, N: tl.constexpr, a0, a1, ok):
    if N == 16:
        return tl.inline_asm_elementwise(TEXT, "=r," * 16 + "l,r", [a0, ok], dtype=(tl.int32,) * 16, is_pure=True,
                                         pack=1)  # fmt: skip
    elif N == 8:
        return tl.inline_asm_elementwise(TEXT, "=r," * 8 + "l,l,r", [a0, a1, ok], dtype=(tl.int32,) * 8,
                                         is_pure=True, pack=1)  # fmt: skip
    elif N == 4:
        return tl.inline_asm_elementwise(TEXT, "=r," * 4 + "l,r", [a0, ok], dtype=(tl.int32,) * 4, is_pure=True,
                                         pack=1)  # fmt: skip
    elif N == 2:
        return tl.inline_asm_elementwise(TEXT, "=r,=r,l,l,r", [a0, a1, ok], dtype=(tl.int32,) * 2, is_pure=True,
                                         pack=1)  # fmt: skip
    else:
        return tl.inline_asm_elementwise(TEXT, "=h,=h,l,l,r", [a0, a1, ok], dtype=(tl.int16,) * 2, is_pure=True,
                                         pack=1)  # fmt: skip


@triton.jit
def _fold(v, acc):
    for i in tl.static_range(len(v)):
        acc = acc ^ v[i].to(tl.int32)
    return acc


@triton.jit
def _step(w_row, s_row, x_row, x_ok, region, s, k0, ok, stride_wn, stride_sn, SCALES: tl.constexpr,
          WORDS: tl.constexpr, X: tl.constexpr, ALLOC: tl.constexpr, GROUP: tl.constexpr):  # fmt: skip
    """One step's loads (two K tiles) as a tuple of registers."""
    lane = tl.arange(0, w_row.shape[0]) % 32
    t = lane % 4
    row8 = 8 * 4 * stride_wn
    out = ()
    for u in tl.static_range(2):
        if WORDS == 2:
            a = region + s * 2048 + u * 1024 + lane * 16
            wa, wb = a, a + 512
        elif WORDS == 1:
            wa = w_row + k0 // 2 + 32 * t + 16 * u
            wb = wa + row8
        else:
            wa = w_row + (k0 + u * 128 + 32 * t) // 2
            wb = wa + row8
        if ALLOC:
            out = out + _ld(_W2_ALLOC, 8, wa, wb, ok)
        else:
            out = out + _ld(_W2, 8, wa, wb, ok)
        if SCALES == 1:
            sa = s_row + ((k0 + u * 128 + 32 * t) // GROUP) * 2
            out = out + _ld(_S16, 1, sa, sa + 8 * 2 * stride_sn, ok)
        if X:
            xa = x_row + (k0 + u * 128 + 32 * t) * 2
            out = out + _ld(_X16, 16, xa, xa, ok & x_ok)
    if SCALES == 2:
        sa = s_row + (k0 // GROUP) * 2
        out = out + _ld(_S1, 4, sa, sa, ok) + _ld(_S1, 4, sa + 8 * 2 * stride_sn, sa, ok)
    if SCALES == 3:
        sa = s_row + ((k0 + 64 * t) // GROUP) * 2
        out = out + _ld(_S32, 2, sa, sa + 8 * 2 * stride_sn, ok)
    return out


@triton.jit
def _pattern_kernel(w_ptr, s_ptr, x_ptr, out_ptr, K, tiles_per_warp, stride_wn, stride_sn, SCALES: tl.constexpr,
                    WORDS: tl.constexpr, X: tl.constexpr, ALLOC: tl.constexpr, SUM: tl.constexpr,
                    GROUP: tl.constexpr, NW: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    lane = tl.arange(0, 32 * NW)
    warp = lane // 32
    g = (lane % 32) // 4
    row = (pid * 16 + g).to(tl.int64)
    w_row = w_ptr.to(tl.int64, bitcast=True) + row * stride_wn * 4
    s_row = s_ptr.to(tl.int64, bitcast=True) + row * stride_sn * 2
    x_row = x_ptr.to(tl.int64, bitcast=True) + g.to(tl.int64) * 0
    x_ok = (g < 1).to(tl.int32)
    region = w_ptr.to(tl.int64, bitcast=True) + pid.to(tl.int64) * (8 * K) + warp * (tiles_per_warp * 1024)
    k_lo = warp * (tiles_per_warp * 128)
    steps = tiles_per_warp // 2
    ok = tl.full((32 * NW,), 1, tl.int32)
    nxt = _step(w_row, s_row, x_row, x_ok, region, 0, k_lo, ok, stride_wn, stride_sn, SCALES, WORDS, X, ALLOC, GROUP)
    acc = tl.zeros((32 * NW,), dtype=tl.int32)
    for s in range(steps):
        cur = nxt
        ok = tl.full((32 * NW,), 1, tl.int32) * (s + 1 < steps).to(tl.int32)
        nxt = _step(w_row, s_row, x_row, x_ok, region, s + 1, k_lo + (s + 1) * 256, ok, stride_wn, stride_sn, SCALES,
                    WORDS, X, ALLOC, GROUP)  # fmt: skip
        acc = _fold(cur, acc)
    if SUM:
        tl.store(out_ptr + pid * 32 + tl.arange(0, 32), tl.xor_sum(tl.reshape(acc, (NW, 32)), axis=0))
    else:
        tl.store(out_ptr + pid * 32 * NW + lane, acc)


def run_pattern(packed: dict, x: torch.Tensor, out: torch.Tensor, scales: int, words: int, xload: int, alloc: int,
                sum_warps: int) -> None:  # fmt: skip
    w, scale = packed["weight_packed"], packed["weight_scale"]
    n, k = w.shape[0], w.shape[1] * 8
    programs, nw, tiles_per_warp = gemv_mma.mma_split(configs._GEMV_MMA, n, k, sm_count(w.device))
    _pattern_kernel[(programs,)](w, scale, x, out, k, tiles_per_warp, w.stride(0), scale.stride(0), SCALES=scales,
                                WORDS=words, X=xload, ALLOC=alloc, SUM=sum_warps, GROUP=k // scale.shape[1], NW=nw,
                                num_warps=nw)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    args = p.parse_args()
    fmt = get_format("int4")
    names = ["int4", "read", *args.variants]
    print(f"{'shape':28} {'bf16':>7} " + " ".join(f"{v:>12}" for v in names) + "   (us; x = read / time)")
    ratios: dict[str, list[float]] = {v: [] for v in names}
    for model, layers in bk.DENSE.items():
        for layer, n, k in layers:
            w = bk.randn(n, k, scale=0.02)
            packed = fmt.random_packed((n, k), device="cuda")
            x = bk.randn(1, k)
            out = torch.empty(max(bk.read_programs(packed), n * 16), dtype=torch.int32, device="cuda")
            bf16 = bk.graph_us(F.linear, x, w)
            t = {"int4": bk.graph_us(kernels.int4_linear, x, packed), "read": bk.graph_us(bk.read_packed, packed, out)}
            for v in args.variants:
                t[v] = bk.graph_us(run_pattern, packed, x, out, *VARIANTS[v])
            for v in names:
                ratios[v].append(t["read"] / t[v])
            cells = " ".join(f"{t[v]:6.1f} ({t['read'] / t[v]:.2f})" for v in names)
            print(f"{model + ' ' + layer:28} {bf16:7.1f} {cells}", flush=True)
            del w, packed
            torch.cuda.empty_cache()
    print("geomean read / time: " + " ".join(
        f"{v} {math.exp(sum(map(math.log, r)) / len(r)):.3f}" for v, r in ratios.items()))  # fmt: skip


if __name__ == "__main__":
    main()
