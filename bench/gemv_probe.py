"""Timing probe of the M = 1 mma GEMV (kernels/gemv_mma.py): what leaving instruction classes out of its per-tile PTX
would gain, on the 12 dense shapes of bench/kernels.py. The outputs are WRONG for every variant but `ship`; only
the time means anything. It bounds what any cheaper decode of the same words can buy at M = 1.

    python bench/gemv_probe.py ship noscale nofma noprmt nodecode

ship: the shipped text. noscale: without the fma by the scale. nofma: without both fmas (the -136 offset and the
scale). noprmt: also without the activation prmts (movs instead). nodecode: also without the shr and lop3 (the raw
word as the operand). loadonly: no mma and no decode at all, the loaded registers only folded into the accumulator
(the floor of this kernel's loads, loop and epilogue). xjit: the shipped tile (right values), each step's
activations loaded in that step instead of one step ahead (fewer registers in flight). early / early-w: a warp
barrier after the next step's loads (all / the words). xshfl: the shipped tile (right values) with each step's
activations loaded spread over the warp, 16 bytes per lane, and handed to each mma by shfl. rN[pP]: the shipped
kernel capped at N registers per thread (with P warps per SM as the grid's target). Each variant runs in a
subprocess of its own (the kernel's PTX is a constexpr, so each text compiles a kernel of its own; the cache dir is
per variant). The variants with right values are then compared bit for bit with ship's outputs.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
from dataclasses import replace

import triton
import triton.language as tl
from orbit_lightning.kernels import gemv_mma

VARIANTS = ("ship", "noscale", "nofma", "noprmt", "nodecode", "loadonly", "xjit", "early", "early-w", "xshfl")


def loadonly_text() -> str:
    """The M = 1 tile's operands (d, 8 words, 2 scales, 16 x registers, c) with no mma and no decode: the words, the
    scales and x xor-folded into c0 (as its bits, so no load can be dropped) and c1-c3 passed through. What is left
    of the kernel is its loads, its loop and its epilogue."""
    regs = [f"${i}" for i in range(4, 12)] + ["s"] + [f"${i}" for i in range(14, 30)]
    lines = ["{", ".reg .b32 q, s;", "mov.b32 s, {$12, $13};", f"lop3.b32 q, {regs[0]}, {regs[1]}, {regs[2]}, 0x96;"]
    rest = regs[3:]
    for i in range(0, len(rest) - 1, 2):
        lines.append(f"lop3.b32 q, q, {rest[i]}, {rest[i + 1]}, 0x96;")
    lines += [
        "and.b32 q, q, 0x00FFFFFF;",  # a tiny float: c0 stays finite
        "add.f32 $0, $30, q;",
        "mov.f32 $1, $31;",
        "mov.f32 $2, $32;",
        "mov.f32 $3, $33;",
        "}",
    ]
    return "\n".join(lines)


def probe_text(text: str, variant: str) -> str:
    """The tile PTX `text` with the instructions `variant` leaves out removed (or made movs)."""
    if variant == "loadonly":
        return loadonly_text()
    out = []
    for line in text.split("\n"):
        s = line.strip()
        scale_fma = s.startswith("fma.rn.bf16x2") and ("slo" in s or "shi" in s)
        if (variant == "noscale" and scale_fma) or (variant in VARIANTS[2:] and s.startswith("fma.rn.bf16x2")):
            continue
        if variant in VARIANTS[3:] and s.startswith("prmt.b32 x"):
            dst, src = (p.rstrip(",") for p in s.split()[1:3])
            line = f"mov.b32 {dst}, {src};"
        if variant == "nodecode" and s.startswith("shr.u32 w"):
            continue
        if variant == "nodecode" and s.startswith("lop3.b32"):
            dst, src = (p.rstrip(",") for p in s.split()[1:3])
            line = f"mov.b32 {dst}, {src};"
        out.append(line)
    return "\n".join(out)


SHIP_MAINLOOP = gemv_mma.mma_mainloop


@triton.jit
def _warp_sync(dep):
    """bar.warp.sync after the loads that produced `dep` (an operand the text never reads, so LLVM keeps those loads
    above it): ptxas moves no memory access across it, so the loads stay at the top of the step."""
    return tl.inline_asm_elementwise("bar.warp.sync -1;", "=r,r", [dep], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def early_mainloop(nxt, w_rows, s_rows, x_rows, x_ok, k_lo, tiles_per_warp, stride_wn, stride_sn,
                   GROUP: tl.constexpr, MT: tl.constexpr, NT: tl.constexpr, U: tl.constexpr, LOAD: tl.constexpr,
                   NW: tl.constexpr, X_EARLY: tl.constexpr):  # fmt: skip
    """gemv_mma.mma_mainloop with a warp barrier after the next step's loads (X_EARLY: words and activations; else
    the words only), which ptxas otherwise issues late in the step, after most of its mmas."""
    ok = tl.full((32 * NW,), 1, tl.int32)
    k_hi = k_lo + tiles_per_warp * gemv_mma._TILE_K
    x_nxt = gemv_mma._load_xs(x_rows, x_ok, k_lo, ok, U, NT)
    acc = gemv_mma.zero_accumulators(MT, NT, NW)
    for i in range(0, tiles_per_warp, U):
        k1 = k_lo + (i + U) * gemv_mma._TILE_K
        cur = nxt
        xv = x_nxt
        ok = (k1 < k_hi).to(tl.int32)
        nxt = gemv_mma._load_weights(w_rows, s_rows, k1, ok, stride_wn, stride_sn, GROUP, U, MT, LOAD)
        if X_EARLY:
            x_nxt = gemv_mma._load_xs(x_rows, x_ok, k1, ok, U, NT)
            _warp_sync(nxt[0][0] + x_nxt[0][0])
        else:
            _warp_sync(nxt[0][0])
            x_nxt = gemv_mma._load_xs(x_rows, x_ok, k1, ok, U, NT)
        acc = gemv_mma.mma_step(acc, cur, xv, MT, NT, U)
    return acc


@triton.jit
def early_both(nxt, w_rows, s_rows, x_rows, x_ok, k_lo, tiles_per_warp, stride_wn, stride_sn, GROUP: tl.constexpr,
        MT: tl.constexpr, NT: tl.constexpr, U: tl.constexpr, LOAD: tl.constexpr, NW: tl.constexpr):  # fmt: skip
    return early_mainloop(nxt, w_rows, s_rows, x_rows, x_ok, k_lo, tiles_per_warp, stride_wn, stride_sn, GROUP, MT,
                          NT, U, LOAD, NW, True)  # fmt: skip


@triton.jit
def early_words(nxt, w_rows, s_rows, x_rows, x_ok, k_lo, tiles_per_warp, stride_wn, stride_sn, GROUP: tl.constexpr,
        MT: tl.constexpr, NT: tl.constexpr, U: tl.constexpr, LOAD: tl.constexpr, NW: tl.constexpr):  # fmt: skip
    return early_mainloop(nxt, w_rows, s_rows, x_rows, x_ok, k_lo, tiles_per_warp, stride_wn, stride_sn, GROUP, MT,
                          NT, U, LOAD, NW, False)  # fmt: skip


@triton.jit
def xjit_mainloop(nxt, w_rows, s_rows, x_rows, x_ok, k_lo, tiles_per_warp, stride_wn, stride_sn, GROUP: tl.constexpr,
        MT: tl.constexpr, NT: tl.constexpr, U: tl.constexpr, LOAD: tl.constexpr, NW: tl.constexpr):  # fmt: skip
    """gemv_mma.mma_mainloop with each step's activations loaded in that step (not one step ahead): the same
    products in the same order, without a step of activation registers in flight."""
    ok = tl.full((32 * NW,), 1, tl.int32)
    k_hi = k_lo + tiles_per_warp * gemv_mma._TILE_K
    acc = gemv_mma.zero_accumulators(MT, NT, NW)
    for i in range(0, tiles_per_warp, U):
        k0 = k_lo + i * gemv_mma._TILE_K
        k1 = k0 + U * gemv_mma._TILE_K
        cur = nxt
        xv = gemv_mma._load_xs(x_rows, x_ok, k0, ok, U, NT)
        nxt = gemv_mma._load_weights(w_rows, s_rows, k1, (k1 < k_hi).to(tl.int32), stride_wn, stride_sn, GROUP, U,
                                     MT, LOAD)  # fmt: skip
        acc = gemv_mma.mma_step(acc, cur, xv, MT, NT, U)
    return acc


def tile_shfl_asm() -> str:
    """gemv_mma._tile_asm(1) with the activations held spread over the warp: lane l has x[8l .. 8l + 7] of the
    step's 256 ($14-$17), and each word's 8 come by shfl from lane $18 + w ($18 = 16u + 4t for tile u). Operands: d
    (4 f32), 8 words, 2 scales, 4 x registers, the source lane base, c (4 f32)."""
    lines = ["{", ".reg .b32 w, one, off, nz, slo, shi, a<4>, b<4>, x<4>, y<4>, q;",
             "mov.b32 one, 0x3F803F80;", "mov.b32 off, 0xC308C308;", "mov.b32 nz, 0x80008000;",
             "mov.b32 slo, {$12, $12};", "mov.b32 shi, {$13, $13};"]  # fmt: skip
    lines += [f"mov.f32 ${i}, ${19 + i};" for i in range(4)]
    for w in range(4):
        lines.append(gemv_mma._decode(f"${4 + w}", "a").replace("{s2}", "slo"))
        lines.append(gemv_mma._decode(f"${8 + w}", "b").replace("{s2}", "shi"))
        lines.append(f"add.u32 q, $18, {w};")
        lines += [f"shfl.sync.idx.b32 y{i}, ${14 + i}, q, 0x1f, -1;" for i in range(4)]
        d = "{$0, $1, $2, $3}"
        mma = f"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {d}"
        lines += ["prmt.b32 x0, y0, y2, 0x5410;", "prmt.b32 x1, y0, y2, 0x7632;", "prmt.b32 x2, y1, y3, 0x5410;",
                  "prmt.b32 x3, y1, y3, 0x7632;"]  # fmt: skip
        lines.append(f"{mma}, {{a0, b0, a1, b1}}, {{x0, x1}}, {d};")
        lines.append(f"{mma}, {{a2, b2, a3, b3}}, {{x2, x3}}, {d};")
    lines.append("}")
    return "\n".join(lines)


_TILE_SHFL = tl.constexpr(tile_shfl_asm())
_LOAD_X1 = tl.constexpr(
    "{\n.reg .pred p;\nsetp.ne.b32 p, $5, 0;\nmov.b32 $0, 0;\nmov.b32 $1, 0;\nmov.b32 $2, 0;\nmov.b32 $3, 0;\n"
    "@p ld.global.v4.u32 {$0, $1, $2, $3}, [$4];\n}"
)
_LANE0 = tl.constexpr("{\n.reg .b32 lo, hi;\nmov.b64 {lo, hi}, $1;\nshfl.sync.idx.b32 lo, lo, 0, 0x1f, -1;\n"
                      "shfl.sync.idx.b32 hi, hi, 0, 0x1f, -1;\nmov.b64 $0, {lo, hi};\n}")  # fmt: skip


@triton.jit
def _load_x1(x_row0, k0, ok):
    """Lane l's 16 bytes x[row 0][k0 + 8l .. k0 + 8l + 7] (4 registers; zeros unless ok)."""
    lane = tl.arange(0, x_row0.shape[0]) % 32
    return tl.inline_asm_elementwise(_LOAD_X1, "=r,=r,=r,=r,l,r", [x_row0 + (k0 + 8 * lane) * 2, ok],
                                     dtype=(tl.int32,) * 4, is_pure=True, pack=1)  # fmt: skip


@triton.jit
def _tile_shfl(w, x, base, acc):
    return tl.inline_asm_elementwise(
        _TILE_SHFL, "=f," * 4 + "r," * 8 + "h,h," + "r," * 4 + "r," + "f,f,f,f",
        [w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7], w[8], w[9], x[0], x[1], x[2], x[3], base, acc[0], acc[1],
         acc[2], acc[3]], dtype=(tl.float32,) * 4, is_pure=True, pack=1)  # fmt: skip


@triton.jit
def xshfl_mainloop(nxt, w_rows, s_rows, x_rows, x_ok, k_lo, tiles_per_warp, stride_wn, stride_sn,
                   GROUP: tl.constexpr, MT: tl.constexpr, NT: tl.constexpr, U: tl.constexpr, LOAD: tl.constexpr,
                   NW: tl.constexpr):  # fmt: skip
    """gemv_mma.mma_mainloop at M = 1 (NT = 1, U = 2) with the step's activations loaded spread over the warp (one
    16-byte load per lane, 4 registers in flight instead of 32) and handed to each mma by shfl."""
    if NT != 1 or U != 2:
        acc = SHIP_MAINLOOP(nxt, w_rows, s_rows, x_rows, x_ok, k_lo, tiles_per_warp, stride_wn, stride_sn, GROUP, MT,
                             NT, U, LOAD, NW)  # fmt: skip
    else:
        ok = tl.full((32 * NW,), 1, tl.int32)
        k_hi = k_lo + tiles_per_warp * gemv_mma._TILE_K
        row0 = tl.inline_asm_elementwise(_LANE0, "=l,l", [x_rows[0]], dtype=tl.int64, is_pure=True, pack=1)
        t = tl.arange(0, 32 * NW) % 4
        x_nxt = _load_x1(row0, k_lo, ok)
        acc = gemv_mma.zero_accumulators(MT, 1, NW)
        for i in range(0, tiles_per_warp, U):
            k1 = k_lo + (i + U) * gemv_mma._TILE_K
            cur = nxt
            xv = x_nxt
            ok = (k1 < k_hi).to(tl.int32)
            nxt = gemv_mma._load_weights(w_rows, s_rows, k1, ok, stride_wn, stride_sn, GROUP, U, MT, LOAD)
            x_nxt = _load_x1(row0, k1, ok)
            new = ()
            for m in tl.static_range(MT):
                a = acc[m]
                for u in tl.static_range(U):
                    a = _tile_shfl(cur[u * MT + m], xv, 16 * u + 4 * t, a)
                new = new + (a,)
            acc = new
    return acc


RIGHT_VALUES = ("xjit", "early", "early-w", "xshfl")  # (and the register caps) multiply like the shipped kernel
PATCHED = {"xjit": xjit_mainloop, "early": early_both, "early-w": early_words, "xshfl": xshfl_mainloop}


def run_variant(variant: str) -> None:
    import torch
    import torch.nn.functional as F

    from orbit_lightning import kernels
    from orbit_lightning.quant.formats import get_format

    cap = re.fullmatch(r"r(\d+)(?:p(\d+))?", variant)
    if cap:  # the shipped kernel under a register cap (ptxas then schedules the loads otherwise), warps per SM
        from orbit_lightning.kernels import configs

        extra = {"maxnreg": int(cap[1])} | ({"programs_per_sm": int(cap[2])} if cap[2] else {})
        for name in ("_GEMV_MMA", "_GEMV_MMA_LONG_K", "_GEMV_MMA_ONE_TILE"):
            setattr(configs, name, replace(getattr(configs, name), **extra))
    elif variant in PATCHED:
        gemv_mma.mma_mainloop = PATCHED[variant]
    elif variant != "ship":
        gemv_mma._TILE1 = tl.constexpr(probe_text(gemv_mma._tile_asm(1), variant))
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location("bench_kernels", os.path.join(here, "kernels.py"))
    bk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bk)
    fmt = get_format("int4")
    ratios, outputs = [], []
    torch.manual_seed(0)  # the same weights in every variant's process, so that outputs compare bit for bit
    for model, layers in bk.DENSE.items():
        for layer, n, k in layers:
            w = bk.randn(n, k, scale=0.02)
            packed = fmt.random_packed((n, k), device="cuda")
            x = bk.randn(1, k)
            bf16, int4 = bk.graph_us(F.linear, x, w), bk.graph_us(kernels.int4_linear, x, packed)
            ratios.append(bf16 / int4)
            outputs.append(kernels.int4_linear(x, packed).cpu())
            line = f"{variant:9} {model:16} {layer:12} bf16 {bf16:7.1f} int4 {int4:7.1f} x {bf16 / int4:5.2f}"
            print(line, flush=True)
            del w, packed
            torch.cuda.empty_cache()
    print(f"{variant:9} GEOMEAN M=1 x {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}", flush=True)
    torch.save(outputs, _outputs_path(variant))


def _outputs_path(variant: str) -> str:
    return os.path.join("/tmp", f"gemv_probe_{variant}.pt")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        return run_variant(sys.argv[2])
    for variant in sys.argv[1:] or VARIANTS:
        if variant not in VARIANTS and not re.fullmatch(r"r\d+(p\d+)?", variant):
            sys.exit(f"bench/gemv_probe.py: unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
        env = dict(os.environ, TRITON_CACHE_DIR=os.path.join("/tmp", f"gemv_probe_{variant}"))
        subprocess.run([sys.executable, __file__, "--child", variant], env=env, check=True)
    import torch

    ran = sys.argv[1:] or VARIANTS
    ship = torch.load(_outputs_path("ship")) if "ship" in ran else None  # (this run's, never a stale file)
    for variant in ran if ship is not None else ():
        if variant in RIGHT_VALUES or variant.startswith("r"):
            same = all(torch.equal(a, b) for a, b in zip(ship, torch.load(_outputs_path(variant)), strict=True))
            print(f"{variant:9} outputs bitwise equal to ship's: {same}", flush=True)


if __name__ == "__main__":
    main()
