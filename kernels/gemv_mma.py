"""Decode GEMV, y[M, N] = x[M, K] @ W^T for M <= 16 and int4 W, on warp-level mma written per thread in PTX (sm_80+).

Why a second GEMV: gemv.py's tile kernel issues ~700 instructions per 4096 weights at M = 1 (sm_90 SASS: its decoded
tile and the activations pass through shared memory, and words load 4 bytes at a time), and splits K across
programs, whose partials, ticket and final sum add a 2.5-3.3 us tail to every launch (bench/gemv_timeline.py). Here:

- Every tensor has one element per thread (shape [32 * NW], a 1-D range, which Triton lays out one element per
  thread in thread order; tests/kernels/test_compile_sm90.py checks it), so a tensor is a register, and inline PTX
  moves exactly the data each lane's mma operands need.
- Warp w of a program covers the program's 16 * MT rows (MT mma row tiles) over its run of K tiles of 128.
  Lane (g, t) = (lane // 4, lane % 4) loads 16 bytes of words of rows g and g + 8 of each row tile (K 32t to
  32t + 31 of the tile: one scale group, so one scale per row), and x[row g (+ 8)][32t .. 32t + 31]: activation
  row g is the mma's column g, so M <= 8 is one n8 tile (the weight work of M = 1) and M <= 16 two.
- It decodes the words with dequant.py's packed-bf16 instructions (the same bf16 weights the other kernels
  multiply) straight into mma A registers; register j of a word holds nibbles j and j + 4, so x is paired the same
  way (int4-tiled stores values 2j, 2j + 1 there, x's own pairs: tile_asm). 8 m16n8k16 mmas per row tile, n8 tile
  and K tile.
- U adjacent K tiles per step (GemvConfig.mma_tiles), the next step's loaded meanwhile, and under PDL the first
  step's weights load before the wait for the previous kernel. With U = 2 a quad of lanes reads a row's whole
  128-byte line per step; with one tile, half a line, and the other half a step later, which measured slower.
- The program's warps meet in a fixed-order sum in shared memory (one reduction of all four accumulator registers):
  no K split across programs, no tail. Without LoRA each sum is stored by the thread that holds it; no output tile
  is assembled (configs.MMA_DIRECT_STORE). The two together took 7 % off the M = 1 launch (bench/RESULTS.md).

Under Triton's interpreter the PTX helpers are emulated with the same per-lane registers (emulate.py), so the kernels
that use them run in CPU tests.

~320 instructions per 4096 weights at M = 1 and ~400 at 16 rows (sm_90 SASS of the main loop: 161 / 202 a row
tile and K tile; 143.5 / 172 on int4-tiled under triton 3.6, whose nibble order spares the activations'
permutes: tile_asm), none through shared memory. Products are fp32 and the order of the sum is fixed, so results
are bitwise reproducible run to run; they equal the other kernels' up to the order of the fp32 summation. The LoRA
epilogue (the adapters in the same launch, gemv_lora.py) is gemv_out.py's, on tiles.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl
from torch import Tensor

from . import configs, emulate
from .configs import TILE_K, GemvConfig, sm_count
from .emulate import INTERPRETED
from .formats import SCALE_GROUPS, TILE_ROWS, PackedWeight
from .gemv_lora import N_COUNTERS, LoraDelta, lora_arrive, lora_leave, lora_rank_program
from .gemv_out import flat_program, launch_args, store_out
from .pdl import launch_dependents, use_pdl, wait_for_producers
from .timeline import stamp

_TILE_K = tl.constexpr(TILE_K)


# Under Triton's interpreter (CPU) inline PTX cannot run: the loads and the mma below are emulated there with the
# same per-lane register contents (emulate.py), so the kernels' addressing, splits and epilogues run in CPU tests.
_EMULATE = tl.constexpr(INTERPRETED)
# A probe (bench/gemv_probe.py xstagger), off: each warp takes its steps after the first in an order rotated by its
# program, so that the grid's programs do not all read the same activation lines of L2 at once.
_STAGGER = tl.constexpr(False)


def _decode(word: str, out: str) -> str:
    """PTX: the four bf16x2 registers out0..out3 of int4 word `word` (out_j = nibbles j and j + 4, minus 8, times
    the scale pair `s2`), dequant.py's _INT4_BF16_ASM instruction for instruction. (Nibbles 2j and 2j + 1 instead,
    wgmma_int4._PAIR_ASM's way, would spare the activations' byte permutes for 2 more instructions a word: measured a
    tie at 1-16 rows, bench/RESULTS.md, thirtieth session.)"""
    text = []
    for j in range(4):
        src = word if j == 0 else "w"
        if j:
            text.append(f"shr.u32 w, {word}, {4 * j};")
        text.append(f"lop3.b32 {out}{j}, {src}, 0x000F000F, 0x43004300, 0xEA;")
    text += [f"fma.rn.bf16x2 {out}{j}, {out}{j}, one, off;" for j in range(4)]
    text += [f"fma.rn.bf16x2 {out}{j}, {out}{j}, {{s2}}, nz;" for j in range(4)]
    return "\n".join(text)


@functools.cache
def tile_asm(nt: int, pairs: bool, paired_nibbles: bool = False) -> str:
    """PTX: one row tile x one K tile for one lane: d = c + W[g, g+8 ; 32 values] . x^T by 8 mmas per n8 tile of
    activation rows (nt of them). Operands: d (4 nt f32); row g's 4 words, row g + 8's; their scales: bf16 g, g + 8,
    or with `pairs` bf16x2 (the scale twice) of g's first and second pair of words, then g + 8's; per n8 tile, x as
    16 bf16x2, 4 per word in the words' K order; c (4 nt f32). The kernels take it as their TILE constexpr.

    `paired_nibbles`: words in int4-tiled's nibble order (values 2j and 2j + 1 in nibbles j and j + 4), so decoded
    register j holds the values 2j, 2j + 1 that activation register j does and the activations go to the mma as
    loaded; in K order (nibble j is value j) each word's four activation registers are first regrouped into the
    pairs (j, j + 4) by four byte permutes per n8 tile: 16 nt of the 161 (M = 1) and 209 (16 rows) instructions of a
    tile, on the integer pipe that the decode's shifts and lop3s load too."""
    words, scales, xs = 4 * nt, 4 * nt + 8, 4 * nt + (12 if pairs else 10)
    cs = xs + 16 * nt
    lines = ["{", ".reg .b32 w, one, off, nz, slo, shi, a<4>, b<4>, x<4>;",
             "mov.b32 one, 0x3F803F80;", "mov.b32 off, 0xC308C308;", "mov.b32 nz, 0x80008000;"]  # fmt: skip
    if not pairs:
        lines += [f"mov.b32 slo, {{${scales}, ${scales}}};", f"mov.b32 shi, {{${scales + 1}, ${scales + 1}}};"]
    lines += [f"mov.f32 ${i}, ${cs + i};" for i in range(4 * nt)]
    for w in range(4):
        lo, hi = (f"${scales + w // 2}", f"${scales + 2 + w // 2}") if pairs else ("slo", "shi")
        lines.append(_decode(f"${words + w}", "a").replace("{s2}", lo))
        lines.append(_decode(f"${words + 4 + w}", "b").replace("{s2}", hi))
        for j in range(nt):
            d = f"{{${4 * j}, ${4 * j + 1}, ${4 * j + 2}, ${4 * j + 3}}}"
            mma = f"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {d}"
            r0, r1, r2, r3 = (f"${xs + 16 * j + 4 * w + i}" for i in range(4))  # x[8w .. 8w+7] as pairs
            if paired_nibbles:
                x0, x1, x2, x3 = r0, r1, r2, r3
            else:
                x0, x1, x2, x3 = "x0", "x1", "x2", "x3"
                lines += [
                    f"prmt.b32 x0, {r0}, {r2}, 0x5410;",
                    f"prmt.b32 x1, {r0}, {r2}, 0x7632;",
                    f"prmt.b32 x2, {r1}, {r3}, 0x5410;",
                    f"prmt.b32 x3, {r1}, {r3}, 0x7632;",
                ]  # (x_j, x_j+4)
            # a0/a2: row g at k (2t, 2t+1) / (2t+8, 2t+9), a1/a3 the same for row g + 8; b0/b1 x at those k.
            lines.append(f"{mma}, {{a0, b0, a1, b1}}, {{{x0}, {x1}}}, {d};")
            lines.append(f"{mma}, {{a2, b2, a3, b3}}, {{{x2}, {x3}}}, {d};")
    lines.append("}")
    return "\n".join(lines)


# No load is predicated: the main loop's last step is peeled (it loads nothing ahead), and activation rows past M
# read row M - 1 (their columns of the products are never stored), so no register is zero-filled for a load that
# may not happen (sm_90 SASS: 24 CS2R a step of two K tiles at M = 1). The weights' loads may carry an L2 prefetch
# size hint (GemvConfig.l2_prefetch): a quad of lanes asks for 64 bytes of a row per K tile, and the rest of the
# row's line follows in the next tile.
#
# Two lane layouts (GemvConfig.mma_word_pairs). Words: lane t of a quad takes words 4t..4t+3 of a row's 16 in a K
# tile (one 16-byte load, one scale group), or with pairs words 2t, 2t + 1, 2t + 8 and 2t + 9 (two 8-byte loads, two
# groups at group 32). A lane's activations are those of its words: with words 4t.., one 16-byte load of activation
# row g reads bytes 64t + 16i, so the quad's four lanes touch both 128-byte lines of the row's K tile and each load
# instruction 16 lines for 8 rows; with pairs the quad's bytes 32t + 16i (+ 128) lie in one line, 8 lines a load.
# At 16 rows, where the loop is limited by L1 wavefronts (4 activation bytes per weight byte), pairs cut a row
# tile's L1 wavefronts per K tile from ~160 to ~112 (bench/RESULTS.md). With pairs each lane loads its rows' scales
# of the whole K tile (8 bytes at group 32, shared by the quad) and a byte permute picks its two groups, each as the
# bf16x2 pair the decode multiplies by.
def _load_w_asm(hint: str, pairs: bool, group: int) -> str:
    """PTX: lane's words of rows g and g + 8 ($0-$7) and their scales ($8, $9 bf16; with pairs $8-$11 bf16x2: row g's
    first and second pair of words, then row g + 8's) from byte addresses $n ... $n + 3 (words of g, of g + 8, scales
    of g, of g + 8; with pairs the scales of the K tile's first group), at scale groups of `group`; with pairs $16 is
    the lane's byte selector (group 32)."""
    ld = f"ld.global.nc.L1::no_allocate{hint}"
    if not pairs:
        return f"""{{
{ld}.v4.u32 {{$0, $1, $2, $3}}, [$10];
{ld}.v4.u32 {{$4, $5, $6, $7}}, [$11];
ld.global.nc.b16 $8, [$12];
ld.global.nc.b16 $9, [$13];
}}"""
    scales = []
    for lo, hi, addr in (("$8", "$9", "$14"), ("$10", "$11", "$15")):
        if group == 32:  # groups t // 2 and 2 + t // 2 of the tile's 4
            scales += [f"ld.global.nc.v2.b32 {{p, q}}, [{addr}];", f"prmt.b32 {lo}, p, 0, $16;",
                       f"prmt.b32 {hi}, q, 0, $16;"]  # fmt: skip
        elif group == 64:  # groups 0 and 1 of the tile's 2
            scales += [f"ld.global.nc.b32 p, [{addr}];", f"prmt.b32 {lo}, p, 0, 0x1010;",
                       f"prmt.b32 {hi}, p, 0, 0x3232;"]  # fmt: skip
        else:  # one group
            scales += [f"ld.global.nc.b16 p, [{addr}];", f"prmt.b32 {lo}, p, 0, 0x1010;", f"mov.b32 {hi}, {lo};"]
    newline = "\n"
    return f"""{{
.reg .b32 p, q;
{ld}.v2.u32 {{$0, $1}}, [$12];
{ld}.v2.u32 {{$2, $3}}, [$12 + 32];
{ld}.v2.u32 {{$4, $5}}, [$13];
{ld}.v2.u32 {{$6, $7}}, [$13 + 32];
{newline.join(scales)}
}}"""


@functools.cache
def load_w_asm(l2_prefetch: int, pairs: bool, group: int) -> str:
    """_load_w_asm for a config's L2 prefetch hint (bytes, 0: none) and lane layout, at scale groups of `group`."""
    return _load_w_asm(f".L2::{l2_prefetch}B" if l2_prefetch else "", pairs, group)


def _load_x_asm(offsets: tuple[int, ...]) -> str:
    """PTX: the lane's 16 activation registers, 16 bytes from each of byte address $16 plus `offsets`."""
    loads = "".join(f"ld.global.v4.u32 {{${4 * i}, ${4 * i + 1}, ${4 * i + 2}, ${4 * i + 3}}}, [$16 + {off}];\n"
                    for i, off in enumerate(offsets))
    return "{\n" + loads + "}"


_LOAD_X = tl.constexpr(_load_x_asm((0, 16, 32, 48)))  # words 4t..4t+3: 64 contiguous bytes
_LOAD_X_PAIRS = tl.constexpr(_load_x_asm((0, 16, 128, 144)))  # words 2t, 2t + 1 and 2t + 8, 2t + 9
# Bytes of a row's K tile, which advance a lane's row-major addresses a K tile: its words and its activations (its
# scales: _s_groups).
_W_BYTES = tl.constexpr(TILE_K // 2)
_X_BYTES = tl.constexpr(TILE_K * 2)
# int4-tiled's layout (quant/formats/tiled.py): words in blocks of TILE_ROWS rows x one K tile (a row's 64 bytes after
# another's), scales in blocks of TILE_ROWS rows x SCALE_GROUPS groups (a row's 16 bytes after another's).
_TILE_ROWS = tl.constexpr(TILE_ROWS)
_SCALE_GROUPS = tl.constexpr(SCALE_GROUPS)
_S_BLOCK = tl.constexpr(TILE_ROWS * SCALE_GROUPS * 2)  # bytes of a scale block


@triton.jit
def _w_ktile(TILED: tl.constexpr):
    """Bytes from a row's words of one K tile to the next: 64 row-major, a block tiled."""
    return (_TILE_ROWS if TILED else 1) * _W_BYTES


@triton.jit
def _s_groups(g, TILED: tl.constexpr):
    """Bytes from a row's scale of group 0 to its group g: 2 g row-major; tiled, g // 8 blocks on and g % 8 scales
    into the row's 16 bytes of that block."""
    if TILED:
        off = (g // _SCALE_GROUPS) * _S_BLOCK + (g % _SCALE_GROUPS) * 2
    else:
        off = g * 2
    return off


@triton.jit
def _s_ktiles(tiles, TILED: tl.constexpr, GROUP: tl.constexpr):
    """Bytes from a row's scales of one K tile to those `tiles` K tiles on: within a step of U tiles, whose first K
    tile is a multiple of U (so its groups never straddle a scale block they do not start); from one trip to the
    next where a trip's groups are whole blocks (mma_mainloop)."""
    return _s_groups(tiles * (_TILE_K // GROUP), TILED)


@triton.jit
def _load_w_rows(wa, sa, STRIDE_W: tl.constexpr, STRIDE_S: tl.constexpr, GROUP: tl.constexpr, LOAD: tl.constexpr,
                 PAIRS: tl.constexpr, TILED: tl.constexpr = False):  # fmt: skip
    """The lane's words and scales of rows g and g + 8 (10 registers, 12 with PAIRS) at byte addresses wa (row g's
    words) and sa (its scale); rows g + 8 are constant offsets (the strides are compile-time; TILED: int4-tiled's
    layout, 8 rows of a block on), which ptxas folds into the loads."""
    wb = wa + (8 * _W_BYTES if TILED else 8 * 4 * STRIDE_W)
    sb = sa + (8 * _SCALE_GROUPS * 2 if TILED else 8 * 2 * STRIDE_S)
    if _EMULATE:
        return emulate.load_w_rows(wa, wb, sa, sb, PAIRS, GROUP)
    if PAIRS:  # (the selector of _load_w_asm's group-32 permute: lanes t >= 2 take the high halves)
        sel = tl.where(tl.arange(0, wa.shape[0]) % 4 >= 2, 0x3232, 0x1010)
        return tl.inline_asm_elementwise(LOAD, "=r," * 12 + "l,l,l,l,r", [wa, wb, sa, sb, sel],
                                         dtype=(tl.int32,) * 12, is_pure=True, pack=1)  # fmt: skip
    else:
        return tl.inline_asm_elementwise(LOAD, "=r," * 8 + "=h,=h,l,l,l,l", [wa, wb, sa, sb],
                                         dtype=(tl.int32,) * 8 + (tl.bfloat16,) * 2, is_pure=True, pack=1)  # fmt: skip


@triton.jit
def _load_x(xa, PAIRS: tl.constexpr):
    """The lane's 32 activations at byte address xa as 16 bf16x2 registers (of its words: _load_w_asm)."""
    if _EMULATE:
        return emulate.load_x(xa, PAIRS)
    asm: tl.constexpr = _LOAD_X_PAIRS if PAIRS else _LOAD_X
    return tl.inline_asm_elementwise(asm, "=r," * 16 + "l", [xa], dtype=(tl.int32,) * 16, is_pure=True, pack=1)


@triton.jit
def _load_weights(w_lane, s_lane, STRIDE_W: tl.constexpr, STRIDE_S: tl.constexpr, GROUP: tl.constexpr,
                  U: tl.constexpr, MT: tl.constexpr, LOAD: tl.constexpr, PAIRS: tl.constexpr,
                  TILED: tl.constexpr = False):  # fmt: skip
    """_load_w_rows of U adjacent K tiles for each of the MT row tiles, tile-major. w_lane / s_lane: tuples of B
    lane_addresses at the first of them; row tile m reads base m % B, 16 (m // B) rows on. One base serves every
    row tile of one weight as compile-time offsets (two live 64-bit addresses a base took MT = 2 past 128
    registers, tests/kernels/test_compile_sm90.py); separate weights (SwiGLU's gate and up) take one base each.
    TILED: the words and scales in int4-tiled's layout, where a row tile is 16 rows of blocks on as
    in row-major, and the next K tile a block on."""
    B: tl.constexpr = len(w_lane)
    out = ()
    for u in tl.static_range(U):
        for m in tl.static_range(MT):
            out = out + (_load_w_rows(w_lane[m % B] + (16 * (m // B) * 4 * STRIDE_W + u * _w_ktile(TILED)),
                                      s_lane[m % B] + (16 * (m // B) * 2 * STRIDE_S + _s_ktiles(u, TILED, GROUP)),
                                      STRIDE_W, STRIDE_S, GROUP, LOAD, PAIRS, TILED),)  # fmt: skip
    return out


@triton.jit
def _load_xs(x_lane, U: tl.constexpr, NT: tl.constexpr, PAIRS: tl.constexpr):
    """_load_x of U adjacent K tiles for each of the NT activation row tiles, tile-major."""
    out = ()
    for u in tl.static_range(U):
        for j in tl.static_range(NT):
            out = out + (_load_x(x_lane[j] + u * _X_BYTES, PAIRS),)
    return out


@triton.jit
def _tile(w, x, acc, NT: tl.constexpr, PAIRS: tl.constexpr, TILE: tl.constexpr, TILED: tl.constexpr):
    """acc (4 NT f32 registers) + one row tile x one K tile (TILE: tile_asm's text, of int4-tiled's nibble order where
    TILED); w: _load_w_rows' 10 registers (12 with PAIRS), x: NT of _load_x's 16."""
    if _EMULATE:
        return emulate.tile(w, x, acc, NT, PAIRS, TILED)
    S: tl.constexpr = "r,r,r,r," if PAIRS else "h,h,"
    if NT == 1:
        return tl.inline_asm_elementwise(TILE, "=f," * 4 + "r," * 8 + S + "r," * 16 + "f,f,f,f", w + x[0] + acc,
                                         dtype=(tl.float32,) * 4, is_pure=True, pack=1)  # fmt: skip
    else:
        return tl.inline_asm_elementwise(TILE, "=f," * 8 + "r," * 8 + S + "r," * 32 + "f," * 7 + "f",
                                         w + x[0] + x[1] + acc, dtype=(tl.float32,) * 8, is_pure=True, pack=1)


@triton.jit
def _advance(addresses, by):
    out = ()
    for i in tl.static_range(len(addresses)):
        out = out + (addresses[i] + by,)
    return out


@triton.jit
def lane_addresses(w_ptr, s_ptr, rows, k_lo, stride_wn, stride_sn, GROUP: tl.constexpr, PAIRS: tl.constexpr,
                   TILED: tl.constexpr = False):  # fmt: skip
    """Byte addresses of the lane's first words (row `rows`, a lane's g, at K = k_lo + 32t, with PAIRS 16t) and of
    their scale (with PAIRS the scale of K = k_lo): the main loop only advances them. stride_wn / stride_sn: a
    row-major row's words / scales; TILED: the words and scales in int4-tiled's layout."""
    kt = k_lo + (16 if PAIRS else 32) * (tl.arange(0, rows.shape[0]) % 4)
    ks = k_lo if PAIRS else kt
    r = rows.to(tl.int64)
    w_base, s_base = w_ptr.to(tl.int64, bitcast=True), s_ptr.to(tl.int64, bitcast=True)
    if TILED:  # row tile r // 16's blocks start where its row-major rows do; then the K tile's, or group's, block
        row_tile, row = r // _TILE_ROWS * _TILE_ROWS, r % _TILE_ROWS
        w_lane = (w_base + row_tile * stride_wn * 4 + (kt // _TILE_K) * _w_ktile(TILED) + row * _W_BYTES
                  + (kt % _TILE_K) // 2)  # fmt: skip
        s_lane = s_base + row_tile * stride_sn * 2 + row * _SCALE_GROUPS * 2 + _s_groups(ks // GROUP, TILED)
    else:
        w_lane = w_base + r * stride_wn * 4 + kt // 2
        s_lane = s_base + r * stride_sn * 2 + (ks // GROUP) * 2
    return w_lane, s_lane


@triton.jit
def activation_lanes(x_ptr, first, end, k_lo, stride_xm, NT: tl.constexpr, PAIRS: tl.constexpr):
    """Byte address of the lane's activations, row `first` + 8 j in n8 tile j (the mma's column g when first = row_0
    + g) at K = k_lo + 32t (16t with PAIRS). Rows from `end` on read row end - 1 instead: their columns are never
    stored."""
    kt = k_lo + (16 if PAIRS else 32) * (tl.arange(0, first.shape[0]) % 4)
    x_lane = ()
    for j in tl.static_range(NT):
        xr = tl.minimum(first + 8 * j, end - 1).to(tl.int64)
        x_lane = x_lane + (x_ptr.to(tl.int64, bitcast=True) + xr * stride_xm * 2 + kt * 2,)
    return x_lane


@triton.jit
def zero_accumulators(MT: tl.constexpr, NT: tl.constexpr, NW: tl.constexpr):
    """MT tuples of 4 NT zero fp32 registers: a warp's accumulators for MT row tiles of NT activation tiles."""
    zero = tl.zeros((32 * NW,), dtype=tl.float32)
    acc = ()
    for _m in tl.static_range(MT):
        if NT == 1:
            acc = acc + ((zero, zero, zero, zero),)
        else:
            acc = acc + ((zero, zero, zero, zero, zero, zero, zero, zero),)
    return acc


@triton.jit
def mma_mainloop(nxt, w_lane, s_lane, x_lane, tiles_per_warp, k_lo, STRIDE_W: tl.constexpr, STRIDE_S: tl.constexpr,
                 GROUP: tl.constexpr, MT: tl.constexpr, NT: tl.constexpr, U: tl.constexpr, LOAD: tl.constexpr,
                 NW: tl.constexpr, PAIRS: tl.constexpr, TILE: tl.constexpr, KSTEP: tl.constexpr,
                 TILED: tl.constexpr = False):  # fmt: skip
    """A warp's accumulators (MT tuples of 4 NT fp32 registers) over its tiles_per_warp K tiles: the weights of the
    lane_addresses w_lane / s_lane times the activations of x_lane (activation_lanes'), all at the warp's first K
    tile, k_lo. nxt: the first step's weights (_load_weights, which the caller may issue before its PDL wait). A trip
    advances KSTEP steps of U K tiles: 1 where a warp's K tiles are adjacent, NW where the program's warps take
    alternate steps (GemvConfig.mma_interleave_k)."""
    # Tiled scales advance a whole number of blocks a trip, or (fewer groups a trip than a block row's 8) are found
    # from the trip's first group: the block it lies in and its place in the block's row (a few integer operations).
    TRIP_GROUPS: tl.constexpr = KSTEP * U * (_TILE_K // GROUP)
    BY_GROUP: tl.constexpr = TILED and TRIP_GROUPS % _SCALE_GROUPS != 0
    # Half a block row a trip from a half-row boundary (9-16 rows at g32: one K tile a step; a warp's first group a
    # multiple of the trip's where its K tiles are adjacent): the trips alternate between the two halves of a block
    # row, so the advance alternates between two constants that sum to a block (sm_90 SASS at 16 rows: 179 -> 172
    # instructions a tile under triton 3.6, 180 -> 173 under 3.9; the registers unchanged).
    HALVES: tl.constexpr = BY_GROUP and KSTEP == 1 and 2 * TRIP_GROUPS == _SCALE_GROUPS and not _STAGGER
    if _STAGGER or (BY_GROUP and not HALVES):  # scales found from a trip's first group
        g_lo = k_lo // GROUP
        s_row = _advance(s_lane, -_s_groups(g_lo, TILED))
    if _STAGGER:  # every trip's addresses from its step, found from the warp's first (step 0) ones
        w0, x0 = w_lane, x_lane
        rest = tl.maximum(tiles_per_warp // U - 1, 1)  # steps after step 0, whose order rotates by program
        turn = tl.program_id(0) % rest
    elif HALVES:
        into_next = (k_lo // GROUP) % _SCALE_GROUPS >= TRIP_GROUPS  # the first trip starts in the second half
        step = tl.where(into_next, _S_BLOCK - 2 * TRIP_GROUPS, 2 * TRIP_GROUPS)
    x_nxt = _load_xs(x_lane, U, NT, PAIRS)
    acc = zero_accumulators(MT, NT, NW)
    # U adjacent K tiles per step, the next step's loaded meanwhile: with U = 2 a quad of lanes reads a row's
    # 128 contiguous bytes (two 64-byte halves of a line) in one step. The last step, which loads nothing, is
    # peeled off, so no load here is predicated. The next step's loads follow this step's products in the source:
    # with them first, triton 3.6's ptxas issued them all before the products and kept both steps live (117
    # registers at one row tile, 140 at two, against 80 and 128 this way in 3.6 and 3.9; sm_90 SASS, 161 instructions
    # a K tile at M = 1). Other warps hide their latency. (The loads first, 128 registers at 16 rows, lost 5 % overall
    # in the thirty-sixth session, as in the twenty-eighth: bench/RESULTS.md; the code is at 2b1fc3b.)
    for _i in range(U, tiles_per_warp, U):
        if _STAGGER:
            j = 1 + (turn + _i // U - 1) % rest
            w_lane = _advance(w0, j * (KSTEP * U * _w_ktile(TILED)))
            s_lane = _advance(s_row, _s_groups(g_lo + j * TRIP_GROUPS, TILED))
            x_lane = _advance(x0, j * (KSTEP * U * _X_BYTES))
        else:
            w_lane = _advance(w_lane, KSTEP * U * _w_ktile(TILED))
            if HALVES:
                s_lane = _advance(s_lane, step)
                step = _S_BLOCK - step
            elif BY_GROUP:
                s_lane = _advance(s_row, _s_groups(g_lo + (_i // U) * TRIP_GROUPS, TILED))
            else:
                s_lane = _advance(s_lane, _s_ktiles(KSTEP * U, TILED, GROUP))
            x_lane = _advance(x_lane, KSTEP * U * _X_BYTES)
        acc = mma_step(acc, nxt, x_nxt, MT, NT, U, PAIRS, TILE, TILED)
        nxt = _load_weights(w_lane, s_lane, STRIDE_W, STRIDE_S, GROUP, U, MT, LOAD, PAIRS, TILED)
        x_nxt = _load_xs(x_lane, U, NT, PAIRS)
    return mma_step(acc, nxt, x_nxt, MT, NT, U, PAIRS, TILE, TILED)


@triton.jit
def mma_step(acc, w, xv, MT: tl.constexpr, NT: tl.constexpr, U: tl.constexpr, PAIRS: tl.constexpr,
             TILE: tl.constexpr, TILED: tl.constexpr):
    """One step's products: acc[m] += row tile m of each of the U K tiles (w: _load_weights') x the activations xv
    (_load_xs')."""
    new = ()
    for m in tl.static_range(MT):
        a = acc[m]
        for u in tl.static_range(U):
            if NT == 1:
                a = _tile(w[u * MT + m], (xv[u],), a, NT, PAIRS, TILE, TILED)
            else:
                a = _tile(w[u * MT + m], (xv[2 * u], xv[2 * u + 1]), a, NT, PAIRS, TILE, TILED)
        new = new + (a,)
    return new


@triton.jit
def _warp_reduce(c0, c1, c2, c3, NW: tl.constexpr):
    """One row tile x one n8 tile of the result summed over the program's warps (their K ranges) in a fixed order, as
    128 values: lane (g, t) holds rows g (c0, c1) and g + 8 (c2, c3) at activation rows 2t (c0, c2) and 2t + 1 (c1,
    c3), and value 4 (4g + t) + 2e + h is row g + 8h at activation row 2t + e. The four registers go through one
    reduction: Triton lowers each cross-warp sum to shared-memory round trips between CTA barriers, so a reduction
    per register paid them four times (19 CTA barriers in the M = 1 epilogue before, 9 now, sm_90 PTX)."""
    c = tl.join(tl.join(c0, c1), tl.join(c2, c3))  # [NW * 32, 2 e, 2 h]
    return tl.sum(tl.reshape(c, (NW, 128)), axis=0)


@triton.jit
def _gather(c0, c1, c2, c3, NW: tl.constexpr):
    """_warp_reduce's values as the [16 rows, 8 activation rows] tile."""
    y = tl.reshape(_warp_reduce(c0, c1, c2, c3, NW), (8, 4, 2, 2))  # [8 g, 4 t, 2 e, 2 h]
    return tl.reshape(tl.permute(y, (3, 0, 1, 2)), (16, 8))


@triton.jit
def _store_reduced(y, out_ptr, row0, col0, M, stride_om):
    """Store _warp_reduce's values y, out^T rows row0 + 0..15 at activation rows col0 + 0..7, where the activation
    row is below M: no tile is assembled (the LoRA epilogue, which works on tiles, takes _gather)."""
    i = tl.arange(0, 128)
    row = row0 + i // 16 + 8 * (i % 2)
    col = col0 + 2 * ((i // 4) % 4) + (i // 2) % 2
    tl.store(out_ptr + col.to(tl.int64) * stride_om + row, y.to(out_ptr.dtype.element_ty), mask=col < M)


@triton.jit
def _stack(a, b, AXIS: tl.constexpr):
    """Concatenate two 2-D tensors of one shape along AXIS."""
    ab = tl.join(a, b)  # [r, c, 2]
    if AXIS == 0:
        return tl.reshape(tl.permute(ab, (2, 0, 1)), (2 * a.shape[0], a.shape[1]))
    else:
        return tl.reshape(tl.permute(ab, (0, 2, 1)), (a.shape[0], 2 * a.shape[1]))


@triton.jit(do_not_specialize=["M", "stride_xm", "N_A", "lst1", "lst2", "lr", "lslices"])
def _gemv_mma_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, stride_xm, stride_om, tiles_per_warp, N_A, la0, la1,
                     la2, lb0, lb1, lb2, ls0, ls1, ls2, lst1, lst2, lr, lslices, lpart, lt, lcnt, stamp_ptr,
                     GROUP: tl.constexpr,
                     MT: tl.constexpr, NT: tl.constexpr, U: tl.constexpr, LOAD: tl.constexpr, NW: tl.constexpr,
                     ONE_ROW: tl.constexpr, PDL: tl.constexpr, LORA: tl.constexpr, BR: tl.constexpr,
                     STAMPS: tl.constexpr, DIRECT: tl.constexpr, PAIRS: tl.constexpr, STRIDE_W: tl.constexpr,
                     STRIDE_S: tl.constexpr, TILE: tl.constexpr, INTERLEAVE: tl.constexpr,
                     TILED: tl.constexpr):  # fmt: skip
    BN: tl.constexpr = 16 * MT
    stamp(stamp_ptr, tl.program_id(0), 0, STAMPS)
    pid_n, _split, _m_tile, is_rank = flat_program(N, 1, N_A, BN)
    if is_rank:
        wait_for_producers(PDL)
        arrived = lora_arrive(lt, LORA)
        lora_rank_program(tl.program_id(0), x_ptr, M, K, stride_xm, la0, la1, la2, lr, lslices, lpart, lt, lcnt,
                          arrived, 16, BR, ONE_ROW, _TILE_K * NW)  # fmt: skip
    else:
        lane = tl.arange(0, 32 * NW)
        warp = lane // 32
        g = (lane % 32) // 4
        # (the host picks warps that divide K's tiles): a run of them each, or with INTERLEAVE alternate steps
        k_lo = warp * (U if INTERLEAVE else tiles_per_warp) * _TILE_K
        w_lane, s_lane = lane_addresses(w_ptr, s_ptr, pid_n * BN + g, k_lo, STRIDE_W, STRIDE_S, GROUP, PAIRS, TILED)
        w_lane, s_lane = (w_lane,), (s_lane,)  # every row tile at a constant offset (_load_weights)
        x_lane = activation_lanes(x_ptr, g, M, k_lo, stride_xm, NT, PAIRS)
        # frozen weights: loaded before the PDL wait
        nxt = _load_weights(w_lane, s_lane, STRIDE_W, STRIDE_S, GROUP, U, MT, LOAD, PAIRS, TILED)
        wait_for_producers(PDL, False)
        arrived = lora_arrive(lt, LORA)
        stamp(stamp_ptr, tl.program_id(0), 4, STAMPS)
        acc = mma_mainloop(nxt, w_lane, s_lane, x_lane, tiles_per_warp, k_lo, STRIDE_W, STRIDE_S, GROUP, MT, NT, U,
                           LOAD, NW, PAIRS, TILE, NW if INTERLEAVE else 1, TILED)
        stamp(stamp_ptr, tl.program_id(0), 5, STAMPS)
        launch_dependents(PDL)  # (here, not after the wait: there it cost registers)
        if LORA or not DIRECT:  # the LoRA epilogue adds its delta to whole tiles
            tiles = ()
            for m in tl.static_range(MT):
                c = acc[m]
                y = _gather(c[0], c[1], c[2], c[3], NW)  # [16, 8]: activation rows 0-7
                if NT == 1:
                    y = _stack(y, tl.zeros((16, 8), dtype=tl.float32), 1)
                else:
                    y = _stack(y, _gather(c[4], c[5], c[6], c[7], NW), 1)
                tiles = tiles + (y,)
            if MT == 1:
                tile = tiles[0]
            else:
                tile = _stack(tiles[0], tiles[1], 0)
            offs_m = tl.arange(0, 16)
            store_out(tile, out_ptr, out_ptr, lcnt, pid_n, 0, 0, offs_m, offs_m < M, M, N, 1, tl.cdiv(N, BN),
                      stride_om, lb0, lb1, lb2, ls0, ls1, ls2, lst1, lst2, lr, lt, arrived, BN, 16, False, BR, LORA)
        else:
            for m in tl.static_range(MT):
                c = acc[m]
                for j in tl.static_range(NT):
                    _store_reduced(_warp_reduce(c[4 * j], c[4 * j + 1], c[4 * j + 2], c[4 * j + 3], NW), out_ptr,
                                   pid_n * BN + 16 * m, 8 * j, M, stride_om)
    lora_leave(lt, arrived, LORA)
    stamp(stamp_ptr, tl.program_id(0), 6, STAMPS)  # (exit in cycles: tails on one clock, bench/gemv_timeline.py)
    stamp(stamp_ptr, tl.program_id(0), 1, STAMPS)


def warps_for(cfg: GemvConfig, programs: int, k: int, sms: int) -> int:
    """Warps per program, each taking an equal run of K tiles (cfg.mma_tiles at a time): the fewest powers
    of two that give about cfg.programs_per_sm warps per SM over `programs` programs, at most cfg.num_warps,
    dividing the K tiles."""
    want = -(-cfg.programs_per_sm * sms // programs)
    tiles = k // TILE_K // cfg.mma_tiles
    nw = 1
    while nw < want and nw * 2 <= cfg.num_warps and tiles % (nw * 2) == 0:
        nw *= 2
    return nw


def mma_split(cfg: GemvConfig, n: int, k: int, sms: int) -> tuple[int, int, int]:
    """(programs, warps per program, K tiles per warp) of the dense kernel for N x K weights."""
    programs = n // cfg.block_n
    nw = warps_for(cfg, programs, k, sms)
    return programs, nw, k // TILE_K // nw


def gemv_mma(x: Tensor, w: PackedWeight, out: Tensor, cfg: GemvConfig, tickets, lora: LoraDelta | None = None,
             stamps: Tensor | None = None) -> Tensor:
    """out[M, N] = x[M, K] @ W^T (+ the LoRA deltas `lora`) for M <= 16, x bf16 on the GPU with rows on 16-byte
    boundaries and `configs.mma_ok` weights; the arguments are gemv.gemv's."""
    m, k = x.shape
    n = w.n
    n_tiles, nw, tiles_per_warp = mma_split(cfg, n, k, sm_count(x.device))
    # Rank programs (LoRA) of NW warps take NW times the one-warp slice: fewer of them hold SM slots.
    launch = launch_args(x, n, lora, 16, cfg.block_n, lambda: tickets(N_COUNTERS), n_tiles, stamps, TILE_K * nw)
    pdl = use_pdl(x.device)
    _gemv_mma_kernel[(launch.rank_programs + n_tiles,)](
        x, w.values, w.scale, out, m, n, k, x.stride(0), out.stride(0), tiles_per_warp, *launch.tail,
        **kernel_constexprs(cfg, m, nw, w.group, w.values.stride(0), w.scale.stride(0), pdl, w.tiled),
        **launch.constexprs,
        launch_pdl=pdl, num_warps=nw, **cfg.launch_options,
    )  # fmt: skip
    return out


def kernel_constexprs(cfg: GemvConfig, m: int, nw: int, group: int, stride_w: int, stride_s: int,
                      pdl: bool, tiled: bool = False) -> dict:  # fmt: skip
    """_gemv_mma_kernel's compile-time arguments for `cfg` at m rows, nw warps a program and weights of scale groups
    `group` with row strides stride_w (words) and stride_s (scales), in int4-tiled's layout if `tiled`, less the
    epilogue's LORA / BR / STAMPS
    (gemv_out.launch_args'): the one list the launch, bench/mma_sass.py and the sm_90 compile test share."""
    nt = 1 if m <= 8 else 2
    return dict(GROUP=group, MT=cfg.block_n // 16, NT=nt, U=cfg.mma_tiles, NW=nw, ONE_ROW=m == 1,
                PDL=pdl, DIRECT=configs.MMA_DIRECT_STORE, PAIRS=cfg.mma_word_pairs,
                STRIDE_W=stride_w, STRIDE_S=stride_s, LOAD=load_w_asm(cfg.l2_prefetch, cfg.mma_word_pairs, group),
                TILE=tile_asm(nt, cfg.mma_word_pairs, tiled), INTERLEAVE=cfg.mma_interleave_k,
                TILED=tiled)  # fmt: skip
