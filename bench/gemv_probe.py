"""Timing probe of the mma GEMV (kernels/gemv_mma.py) at 1-16 rows: what leaving instruction classes out of its
per-tile PTX would gain, on the 12 dense shapes of bench/kernels.py. The outputs are WRONG for every variant but
`ship`, the register caps, xcopies and xstagger; only the time means anything. It bounds what any cheaper decode
of the same words can buy.

    python bench/gemv_probe.py [--m ROWS] [--layout auto|row-major|tiled] [--wide-tiles U] [ship noscale nofma
                               noprmt nodecode loadonly x1 s1 w16 xcopies xstagger rN[pP]]

ship: the shipped text. noscale: without the fma by the scale. nofma: without both fmas (the -136 offset and the
scale). noprmt: also without the activation prmts (movs instead; int4-tiled's nibble order has none, so there it is
nofma). nodecode: also without the shr and lop3 (the raw word as the operand). loadonly: no mma and no decode at
all, every loaded register only folded into the accumulator: the floor of this kernel's loads, loop and epilogue
at any row count, which no cheaper arithmetic on the same loads can pass. x1 / s1: every lane's activations from
the first row of its n8 tile (one 128-byte line a load instead of 8 at 9-16 rows), or its rows' scales from the row
tile's first row; what the L1 wavefronts of those loads cost (`--m 16`: at M = 1 x1 is ship). s1 also reads fewer
scale bytes from DRAM (a twelfth of the int4 bytes at group 32). w16 (row-major only): at 9-16 rows (the word-pair
layout), each row's words by one 16-byte load instead of two 8-byte ones (half their L1 wavefronts; the bytes are
the right rows' but the wrong words), capped at the shipped 80 registers (8 bytes of stack under triton 3.6).
xcopies: program p reads its activations from copy p % X_COPIES of them (the right values): every program of the
grid reads the same activation lines at about the same K, so each line's L2 slice serves every SM's request for it;
with copies, each serves an eighth. If that hot spot is what holds the 16-row kernel (whose x requests are 4x its
weight bytes, and whose time is the same on an H100 and an H200, which share the L2's design), xcopies is much faster
than ship, although it reads 8x the activation bytes from DRAM. Its outputs are ship's, bit for bit.
xstagger: the fix that would follow, with no extra bytes: each warp takes its steps after the first in an order
rotated by its program (gemv_mma._STAGGER), so the programs read different activation lines at once (step 0 they
all still read together), capped at the shipped 80 registers. Its outputs are right, summed in another order.
rN[pP]: the shipped kernel capped at N registers per thread (with P warps per SM as the grid's target).
--layout: the int4 weights' layout; auto is what model.int4_layout=auto stores on CUDA (int4-tiled).
--wide-tiles U: K tiles a step at 9-16 rows (configs.MMA_WIDE_TILES, shipped 1; 2 doubles each warp's weight bytes in
flight and its activation registers): with loadonly, whether more bytes in flight a warp speed this kernel's loads.

Each variant runs in a subprocess of its own (the kernel's PTX is a constexpr, so each text compiles a kernel of its
own; the cache dir is per variant). The register caps, whose values are right, are then compared bit for bit with
ship's outputs. (The main-loop variants xjit, early, early-w and xshfl, measured and lost in the twenty-first and
twenty-second sessions, left with the main loop they patched; they are at fbf5c3f.)
"""

from __future__ import annotations

import argparse
import functools
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

from orbit_lightning.quant.formats import INT4_LAYOUTS, int4_storage_name

VARIANTS = ("ship", "noscale", "nofma", "noprmt", "nodecode", "loadonly", "x1", "s1", "w16", "xcopies", "xstagger")
_real_lanes, _real_activations = gemv_mma.lane_addresses, gemv_mma.activation_lanes
_real_load_w = gemv_mma.load_w_asm


@triton.jit
def _scales_of_first_row(w_ptr, s_ptr, rows, k_lo, stride_wn, stride_sn, GROUP: tl.constexpr, PAIRS: tl.constexpr,
                         TILED: tl.constexpr = False):  # fmt: skip
    """lane_addresses, with every lane's scale address that of its row tile's first row (rows g, g + 8 of a tile
    start at a multiple of 16; the row g + 8 offset stays compile-time)."""
    w_lane, _ = _real_lanes(w_ptr, s_ptr, rows, k_lo, stride_wn, stride_sn, GROUP, PAIRS, TILED)
    _, s_lane = _real_lanes(w_ptr, s_ptr, rows // 16 * 16, k_lo, stride_wn, stride_sn, GROUP, PAIRS, TILED)
    return w_lane, s_lane


@triton.jit
def _activations_of_first_row(x_ptr, first, end, k_lo, stride_xm, NT: tl.constexpr, PAIRS: tl.constexpr):
    """activation_lanes with every lane of an n8 tile on its first row."""
    return _real_activations(x_ptr, first * 0, end, k_lo, stride_xm, NT, PAIRS)


X_COPIES = 8  # xcopies: how many copies of the activations the programs spread their reads over
_X_COPIES = tl.constexpr(X_COPIES)  # (what a jit function may read of it)


@triton.jit
def _activations_of_a_copy(x_ptr, first, end, k_lo, stride_xm, NT: tl.constexpr, PAIRS: tl.constexpr):
    """activation_lanes in copy program_id % X_COPIES of the activations, 16 rows of x's storage apart (x must be the
    first rows of a buffer of 16 X_COPIES rows: copies_of)."""
    lanes = _real_activations(x_ptr, first, end, k_lo, stride_xm, NT, PAIRS)
    return gemv_mma._advance(lanes, (tl.program_id(0) % _X_COPIES) * 16 * stride_xm * 2)


def copies_of(x):
    """x [m <= 16, K] as the first rows of a buffer of X_COPIES copies of it, 16 rows apart."""
    buf = x.new_zeros(X_COPIES, 16, x.shape[1])
    buf[:, : x.shape[0]] = x
    return buf.view(16 * X_COPIES, x.shape[1])[: x.shape[0]]


@triton.jit
def _words_at_sixteen_bytes(w_ptr, s_ptr, rows, k_lo, stride_wn, stride_sn, GROUP: tl.constexpr,
                            PAIRS: tl.constexpr):  # fmt: skip
    """lane_addresses with the words of the shipped layout (lane t at byte 16t of its row's K tile) and the scales of
    `PAIRS`: for w16's one 16-byte load a row."""
    w_lane, _ = _real_lanes(w_ptr, s_ptr, rows, k_lo, stride_wn, stride_sn, GROUP, False)
    _, s_lane = _real_lanes(w_ptr, s_ptr, rows, k_lo, stride_wn, stride_sn, GROUP, PAIRS)
    return w_lane, s_lane


def _one_load_a_row(l2_prefetch: int, pairs: bool, group: int) -> str:
    """load_w_asm with the word-pair layout's two 8-byte loads a row made one 16-byte load (the quad's 64 contiguous
    bytes: half the weights' L1 wavefronts; its words are the wrong ones)."""
    text = _real_load_w(l2_prefetch, pairs, group)
    if not pairs:
        return text
    lines = text.split("\n")
    first = [i for i, line in enumerate(lines) if ".v2.u32" in line]
    ld = lines[first[0]].split(" {")[0].replace(".v2.", ".v4.")
    loads = [f"{ld} {{$0, $1, $2, $3}}, [$12];", f"{ld} {{$4, $5, $6, $7}}, [$13];"]
    return "\n".join(lines[: first[0]] + loads + lines[first[-1] + 1:])


# variant -> the gemv_mma names it replaces
_ADDRESS_PROBES = {"x1": {"activation_lanes": _activations_of_first_row},
                   "s1": {"lane_addresses": _scales_of_first_row},
                   "w16": {"lane_addresses": _words_at_sixteen_bytes, "load_w_asm": _one_load_a_row},
                   "xcopies": {"activation_lanes": _activations_of_a_copy}}


def loadonly_text(nt: int, pairs: bool) -> str:
    """tile_asm's operands (d: 4 nt f32; 8 words; scales: 2 bf16, or 4 bf16x2 with pairs; 16 nt x registers; c: 4 nt
    f32) with no mma and no decode: every word, scale and x register xor-folded into c0 (as its bits, so no load can
    be dropped) and the rest of c passed through. What is left of the kernel is its loads, its loop and its
    epilogue."""
    words, scales = 4 * nt, 4 * nt + 8
    xs = scales + (4 if pairs else 2)
    cs = xs + 16 * nt
    folded = [f"${i}" for i in range(words, words + 8)]
    lines = ["{", ".reg .b32 q;"]
    if pairs:
        folded += [f"${i}" for i in range(scales, xs)]
    else:  # two 16-bit operands: one 32-bit register
        lines += [".reg .b32 s;", f"mov.b32 s, {{${scales}, ${scales + 1}}};"]
        folded.append("s")
    folded += [f"${i}" for i in range(xs, cs)]
    lines.append(f"lop3.b32 q, {folded[0]}, {folded[1]}, {folded[2]}, 0x96;")  # (0x96: a ^ b ^ c)
    rest = folded[3:]
    lines += [f"lop3.b32 q, q, {a}, {b}, 0x96;" for a, b in zip(rest[::2], rest[1::2], strict=False)]
    if len(rest) % 2:
        lines.append(f"xor.b32 q, q, {rest[-1]};")
    lines += ["and.b32 q, q, 0x00FFFFFF;",  # a tiny float: c0 stays finite
              f"add.f32 $0, ${cs}, q;"] + [f"mov.f32 ${i}, ${cs + i};" for i in range(1, 4 * nt)]  # fmt: skip
    return "\n".join(lines + ["}"])


def probe_text(text: str, variant: str, nt: int = 1, pairs: bool = False) -> str:
    """The tile PTX `text` (of nt n8 tiles and `pairs` scales) with the instructions `variant` leaves out removed (or
    made movs)."""
    if variant == "loadonly":
        return loadonly_text(nt, pairs)
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


def _set_mma_configs(**fields) -> None:
    """The mma GEMV's dense configs (those the dispatch picks at 1-16 rows) with `fields` replaced."""
    from orbit_lightning.kernels import configs

    for name in ("_GEMV_MMA", "_GEMV_MMA_LONG_K", "_GEMV_MMA_ONE_TILE"):
        setattr(configs, name, replace(getattr(configs, name), **fields))


def run_variant(variant: str, m: int, layout: str, wide_tiles: int | None = None) -> None:
    import torch
    import torch.nn.functional as F
    from orbit_lightning.kernels import configs

    from orbit_lightning import kernels
    from orbit_lightning.quant.formats import get_format

    if wide_tiles is not None:
        configs.MMA_WIDE_TILES = wide_tiles

    cap = re.fullmatch(r"r(\d+)(?:p(\d+))?", variant)
    if cap:  # the shipped kernel under a register cap (ptxas then schedules the loads otherwise), warps per SM
        _set_mma_configs(maxnreg=int(cap[1]), **({"programs_per_sm": int(cap[2])} if cap[2] else {}))
    elif variant in _ADDRESS_PROBES:
        for name, probe in _ADDRESS_PROBES[variant].items():  # (resolved at compile time, in this process's cache)
            setattr(gemv_mma, name, probe)
        if variant == "w16":  # (82 registers uncapped, triton 3.6: two 8-warp programs a SM instead of three)
            _set_mma_configs(maxnreg=80)
    elif variant == "xstagger":
        gemv_mma._STAGGER = tl.constexpr(True)  # (read when the kernel compiles, in this process)
        _set_mma_configs(maxnreg=80)  # (its step arithmetic took up to 84: two 8-warp programs a SM, not three)
    elif variant != "ship":
        real = gemv_mma.tile_asm  # (kernel_constexprs passes its text to the kernel)
        gemv_mma.tile_asm = lambda nt, pairs, *nibbles: probe_text(real(nt, pairs, *nibbles), variant, nt, pairs)
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location("bench_kernels", os.path.join(here, "kernels.py"))
    bk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bk)
    fmt = get_format(int4_storage_name("int4", layout, torch.device("cuda")))
    int4_linear = functools.partial(kernels.dequant_linear, fmt=fmt)
    ratios, outputs = [], []
    torch.manual_seed(0)  # the same weights in every variant's process, so that outputs compare bit for bit
    for model, layers in bk.DENSE.items():
        for layer, n, k in layers:
            w = bk.randn(n, k, scale=0.02)
            packed = fmt.random_packed((n, k), device="cuda")
            x = bk.randn(m, k)
            if variant == "xcopies":  # (each copy holds x's values: the outputs stay ship's)
                x = copies_of(x)
            bf16, int4 = bk.graph_us(F.linear, x, w), bk.graph_us(int4_linear, x, packed=packed)
            ratios.append(bf16 / int4)
            outputs.append(int4_linear(x, packed=packed).cpu())
            line = f"{variant:9} {model:16} {layer:12} bf16 {bf16:7.1f} int4 {int4:7.1f} x {bf16 / int4:5.2f}"
            print(line, flush=True)
            del w, packed
            torch.cuda.empty_cache()
    geomean = math.exp(sum(map(math.log, ratios)) / len(ratios))
    print(f"{variant:9} GEOMEAN M={m} {fmt.name} x {geomean:.3f}", flush=True)
    torch.save(outputs, _outputs_path(variant))


def _outputs_path(variant: str) -> str:
    return os.path.join("/tmp", f"gemv_probe_{variant}.pt")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="*",
                    help=f"{', '.join(VARIANTS)} or rN[pP] (default: all but the caps, and w16 unless row-major)")
    ap.add_argument("--m", type=int, default=1, choices=range(1, 17), metavar="ROWS", help="activation rows, 1-16")
    ap.add_argument("--layout", choices=INT4_LAYOUTS, default="auto",
                    help="the int4 weights' layout, as model.int4_layout (auto: int4-tiled on CUDA)")
    ap.add_argument("--wide-tiles", type=int, choices=(1, 2), metavar="U",
                    help="K tiles a step at 9-16 rows (configs.MMA_WIDE_TILES; default: the shipped 1)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    opts = ap.parse_args()
    args, m = opts.variants, opts.m
    if opts.child:
        return run_variant(args[0], m, opts.layout, opts.wide_tiles)
    ran = args or [v for v in VARIANTS if v != "w16" or opts.layout == "row-major"]
    for variant in ran:
        if variant not in VARIANTS and not re.fullmatch(r"r\d+(p\d+)?", variant):
            sys.exit(f"bench/gemv_probe.py: unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
        if variant == "w16" and opts.layout != "row-major":
            sys.exit("bench/gemv_probe.py: w16 patches the row-major word-pair loads; add --layout row-major")
    for variant in ran:
        if os.path.exists(_outputs_path(variant)):  # (a variant that fails leaves no file to compare)
            os.remove(_outputs_path(variant))
        env = dict(os.environ, TRITON_CACHE_DIR=os.path.join("/tmp", f"gemv_probe_{variant}"))
        child = [sys.executable, __file__, "--m", str(m), "--layout", opts.layout, "--child", variant]
        child += ["--wide-tiles", str(opts.wide_tiles)] if opts.wide_tiles else []
        if subprocess.run(child, env=env).returncode:  # (one variant that fails to build leaves the others' times)
            print(f"{variant:9} FAILED (its traceback is above)", flush=True)
    import torch

    ship = torch.load(_outputs_path("ship")) if os.path.exists(_outputs_path("ship")) else None  # (this run's)
    for variant in ran if ship is not None else ():
        # (the register caps and xcopies multiply like the shipped kernel)
        if (variant.startswith("r") or variant == "xcopies") and os.path.exists(_outputs_path(variant)):
            same = all(torch.equal(a, b) for a, b in zip(ship, torch.load(_outputs_path(variant)), strict=True))
            print(f"{variant:9} outputs bitwise equal to ship's: {same}", flush=True)


if __name__ == "__main__":
    main()
