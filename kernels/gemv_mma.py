"""Batch-1 decode GEMV, y[1, N] = x[1, K] @ W^T for int4 W, on warp-level mma written per thread in PTX (sm_80+).

Why a second GEMV: the tile kernel in gemv.py runs ~700 instructions per 4096 weights at M = 1 (sm_90 SASS: its
decoded tile and the activations each pass through shared memory, words load 4 bytes at a time), which is more
than an SM can issue while HBM streams the weights; a decode GEMV then took 2-2.7x its bandwidth time
(bench/gemv_timeline.py, bench/RESULTS.md). Here every step is explicit:

- Every tensor has one element per thread (shape [32 * NUM_WARPS], a 1-D range, which Triton lays out one element
  per thread in thread order; tests/kernels/test_compile_sm90.py checks the layout), so a tensor is a register
  and inline PTX moves exactly the data each lane's mma operands need.
- Warp w of a program covers the program's 16 * MT rows (MT mma row tiles) over K tiles w*T .. w*T+T-1 of 128.
  Lane (g, t) = (lane // 4, lane % 4) loads 16 bytes of words of rows g and g + 8 of each row tile (K 32t to
  32t + 31 of the tile: one scale group, so one scale per row), and x[32t .. 32t + 31].
- It decodes the words with dequant.py's packed-bf16 decoder (the same instructions, so the same bf16 weights
  the other kernels multiply) straight into mma A registers: register j of a word holds nibbles j and j + 4, so
  x is paired the same way, and lane t's operands cover its own 32 values of K. 8 m16n8k16 mmas per row tile.
- x is given to every mma column, so every column of the result is y; the program's warps then meet in a
  fixed-order sum (no split of K across programs: no partials in memory, no ticket, no reduction tail).

Weights load one tile ahead, and under PDL the first tile's load precedes the wait for the previous kernel.
Products are fp32 and the order of the sum is fixed, so results are bitwise reproducible run to run; they equal
the other kernels' up to the order of the fp32 summation. The epilogue (LoRA in the launch, gemv_lora.py) is
gemv.py's.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from .configs import TILE_K, GemvConfig, sm_count
from .formats import PackedWeight
from .gemv_lora import N_COUNTERS, LoraDelta, lora_rank_program
from .gemv_out import flat_program, launch_args, store_out
from .pdl import use_pdl, wait_for_producers
from .timeline import stamp

_TILE_K = tl.constexpr(TILE_K)


def _decode(word: str, out: str) -> str:
    """PTX: the four bf16x2 registers out0..out3 of int4 word `word` (out_j = nibbles j and j + 4, minus 8, times
    the scale pair `s2`), dequant.py's _INT4_BF16_ASM instruction for instruction."""
    text = []
    for j in range(4):
        src = word if j == 0 else "w"
        if j:
            text.append(f"shr.u32 w, {word}, {4 * j};")
        text.append(f"lop3.b32 {out}{j}, {src}, 0x000F000F, 0x43004300, 0xEA;")
    text += [f"fma.rn.bf16x2 {out}{j}, {out}{j}, one, off;" for j in range(4)]
    text += [f"fma.rn.bf16x2 {out}{j}, {out}{j}, {{s2}}, nz;" for j in range(4)]
    return "\n".join(text)


def _tile_asm() -> str:
    """One row tile x one K tile for one lane: d = c + W[g, g+8 ; 32 values] . x[32 values] by 8 mmas.
    Operands: $0-$3 d (f32); $4-$7 row g's words, $8-$11 row g + 8's; $12, $13 their bf16 scales; $14-$29 x as
    16 bf16x2 (natural order); $30-$33 c."""
    lines = ["{", ".reg .b32 w, one, off, nz, slo, shi, a<4>, b<4>, x<4>;",
             "mov.b32 one, 0x3F803F80;", "mov.b32 off, 0xC308C308;", "mov.b32 nz, 0x80008000;",
             "mov.b32 slo, {$12, $12};", "mov.b32 shi, {$13, $13};"]  # fmt: skip
    lines += [f"mov.f32 ${i}, ${30 + i};" for i in range(4)]
    mma = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}"
    for w in range(4):
        lines.append(_decode(f"${4 + w}", "a").replace("{s2}", "slo"))
        lines.append(_decode(f"${8 + w}", "b").replace("{s2}", "shi"))
        r0, r1, r2, r3 = (f"${14 + 4 * w + i}" for i in range(4))  # x[8w .. 8w+7] as pairs (0,1) (2,3) (4,5) (6,7)
        lines += [
            f"prmt.b32 x0, {r0}, {r2}, 0x5410;",
            f"prmt.b32 x1, {r0}, {r2}, 0x7632;",
            f"prmt.b32 x2, {r1}, {r3}, 0x5410;",
            f"prmt.b32 x3, {r1}, {r3}, 0x7632;",
        ]  # (x_j, x_j+4)
        # a0/a2: row g at k (2t, 2t+1) / (2t+8, 2t+9), a1/a3 the same for row g + 8; b0/b1 x at those k.
        lines.append(f"{mma}, {{a0, b0, a1, b1}}, {{x0, x1}}, {{$0, $1, $2, $3}};")
        lines.append(f"{mma}, {{a2, b2, a3, b3}}, {{x2, x3}}, {{$0, $1, $2, $3}};")
    lines.append("}")
    return "\n".join(lines)


_TILE = tl.constexpr(_tile_asm())
# Loads are predicated off only past a warp's last tile (the prefetch one step ahead), whose zeros are never read.
# The weights' loads may carry an L2 prefetch size hint (GemvConfig.l2_prefetch): a quad of lanes asks for 64 bytes
# of a row per K tile, and the rest of the row's line follows in the next tile.
def _load_w_asm(hint: str) -> str:
    return f"""{{
.reg .pred p;
setp.ne.b32 p, $14, 0;
mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0;
mov.b32 $4, 0; mov.b32 $5, 0; mov.b32 $6, 0; mov.b32 $7, 0;
mov.b16 $8, 0; mov.b16 $9, 0;
@p ld.global.nc.L1::no_allocate{hint}.v4.u32 {{$0, $1, $2, $3}}, [$10];
@p ld.global.nc.L1::no_allocate{hint}.v4.u32 {{$4, $5, $6, $7}}, [$11];
@p ld.global.nc.b16 $8, [$12];
@p ld.global.nc.b16 $9, [$13];
}}"""


_HINTS = {size: _load_w_asm(f".L2::{size}B" if size else "") for size in (0, 64, 128, 256)}
_LOAD_X = tl.constexpr(
    "{\n.reg .pred p;\nsetp.ne.b32 p, $17, 0;\n"
    + "".join(f"mov.b32 ${i}, 0;\n" for i in range(16))
    + "".join(f"@p ld.global.v4.u32 {{${4 * i}, ${4 * i + 1}, ${4 * i + 2}, ${4 * i + 3}}}, [$16 + {16 * i}];\n"
              for i in range(4))
    + "}"
)  # fmt: skip


@triton.jit
def _load_w_rows(w_row, s_row, k0, ok, stride_wn, stride_sn, GROUP: tl.constexpr, HINT: tl.constexpr):
    """_load_w for rows g and g + 8 (the scale row of g + 8 is 8 scale rows on)."""
    t = tl.arange(0, w_row.shape[0]) % 4
    kt = k0 + 32 * t
    wa = w_row + kt // 2
    sa = s_row + (kt // GROUP) * 2
    return tl.inline_asm_elementwise(
        HINT, "=r,=r,=r,=r,=r,=r,=r,=r,=h,=h,l,l,l,l,r",
        [wa, wa + 8 * 4 * stride_wn, sa, sa + 8 * 2 * stride_sn, ok],
        dtype=(tl.int32,) * 8 + (tl.bfloat16,) * 2, is_pure=True, pack=1)  # fmt: skip


@triton.jit
def _load_x(x_addr, k0, ok):
    """x[k0 + 32t .. k0 + 32t + 31] for lane t as 16 bf16x2 registers (zeros unless ok)."""
    t = tl.arange(0, x_addr.shape[0]) % 4
    return tl.inline_asm_elementwise(_LOAD_X, "=r," * 16 + "l,r", [x_addr + (k0 + 32 * t) * 2, ok],
                                     dtype=(tl.int32,) * 16, is_pure=True, pack=1)  # fmt: skip


@triton.jit
def _load_weights(w_rows, s_rows, k, ok, stride_wn, stride_sn, GROUP: tl.constexpr, U: tl.constexpr,
                  MT: tl.constexpr, HINT: tl.constexpr):  # fmt: skip
    """_load_w_rows of the U tiles from K = k for each of the MT row tiles, tile-major."""
    out = ()
    for u in tl.static_range(U):
        for m in tl.static_range(MT):
            out = out + (_load_w_rows(w_rows[m], s_rows[m], k + u * _TILE_K, ok, stride_wn, stride_sn, GROUP, HINT),)
    return out


@triton.jit
def _load_xs(x_addr, k, ok, U: tl.constexpr):
    """_load_x of the U tiles from K = k."""
    out = ()
    for u in tl.static_range(U):
        out = out + (_load_x(x_addr, k + u * _TILE_K, ok),)
    return out


@triton.jit
def _tile(w, x, acc):
    """acc (4 f32 registers) + one row tile x one K tile (see _tile_asm); w: _load_w_rows' 10 registers, x:
    _load_x's 16."""
    return tl.inline_asm_elementwise(
        _TILE, "=f,=f,=f,=f," + "r," * 8 + "h,h," + "r," * 16 + "f,f,f,f",
        [w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7], w[8], w[9], x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7],
         x[8], x[9], x[10], x[11], x[12], x[13], x[14], x[15], acc[0], acc[1], acc[2], acc[3]],
        dtype=(tl.float32,) * 4, is_pure=True, pack=1)  # fmt: skip


@triton.jit(do_not_specialize=["N_A", "lst1", "lst2", "lr", "lslices"])
def _gemv_mma_kernel(x_ptr, w_ptr, s_ptr, out_ptr, N, K, tiles_per_warp, stride_wn, stride_sn,
                     N_A, la0, la1, la2, lb0, lb1, lb2, ls0, ls1, ls2, lst1, lst2, lr, lslices, lpart, lt, lcnt,
                     stamp_ptr, GROUP: tl.constexpr, MT: tl.constexpr, U: tl.constexpr, HINT: tl.constexpr,
                     NW: tl.constexpr, PDL: tl.constexpr, LORA: tl.constexpr, BR: tl.constexpr,
                     STAMPS: tl.constexpr):  # fmt: skip
    BN: tl.constexpr = 16 * MT
    stamp(stamp_ptr, tl.program_id(0), 0, STAMPS)
    pid_n, _split, _m_tile, is_rank = flat_program(N, 1, N_A, BN)
    if is_rank:
        wait_for_producers(PDL)
        lora_rank_program(tl.program_id(0), x_ptr, 1, K, K, la0, la1, la2, lr, lslices, lpart, lt, lcnt, 16, BR,
                          True)  # fmt: skip
    else:
        lane = tl.arange(0, 32 * NW)
        warp = lane // 32
        g = (lane % 32) // 4
        k_lo = warp * (tiles_per_warp * _TILE_K)  # (the host picks warps that divide K's tiles)
        k_hi = k_lo + tiles_per_warp * _TILE_K
        # Byte addresses of row g's words and scales in each row tile (rows g + 8 are 8 rows on).
        rows = pid_n * BN + g
        w_rows = ()
        s_rows = ()
        for m in tl.static_range(MT):
            r = (rows + 16 * m).to(tl.int64)
            w_rows = w_rows + (w_ptr.to(tl.int64, bitcast=True) + r * stride_wn * 4,)
            s_rows = s_rows + (s_ptr.to(tl.int64, bitcast=True) + r * stride_sn * 2,)
        x_addr = x_ptr.to(tl.int64, bitcast=True) + 0 * lane.to(tl.int64)
        ok = tl.full((32 * NW,), 1, tl.int32)
        # frozen weights: loaded before the PDL wait
        nxt = _load_weights(w_rows, s_rows, k_lo, ok, stride_wn, stride_sn, GROUP, U, MT, HINT)
        wait_for_producers(PDL)
        stamp(stamp_ptr, tl.program_id(0), 4, STAMPS)
        x_nxt = _load_xs(x_addr, k_lo, ok, U)
        zero = tl.zeros((32 * NW,), dtype=tl.float32)
        acc = ()
        for _m in tl.static_range(MT):
            acc = acc + ((zero, zero, zero, zero),)
        # U adjacent K tiles per step, the next step's loaded meanwhile: with U = 2 a quad of lanes reads a row's
        # 128 contiguous bytes (two 64-byte halves of a line) in one step.
        for i in range(0, tiles_per_warp, U):
            k1 = k_lo + (i + U) * _TILE_K
            cur = nxt
            xv = x_nxt
            ok = (k1 < k_hi).to(tl.int32)
            nxt = _load_weights(w_rows, s_rows, k1, ok, stride_wn, stride_sn, GROUP, U, MT, HINT)
            x_nxt = _load_xs(x_addr, k1, ok, U)
            new = ()
            for m in tl.static_range(MT):
                a = acc[m]
                for u in tl.static_range(U):
                    a = _tile(cur[u * MT + m], xv[u], a)
                new = new + (a,)
            acc = new
        stamp(stamp_ptr, tl.program_id(0), 5, STAMPS)
        # Lane (g, t) holds y[g] in acc[m][0] and y[g + 8] in acc[m][2] of its warp's K range (every t alike):
        # sum the warps in a fixed order, then gather the rows.
        y = ()
        for m in tl.static_range(MT):
            lo = tl.max(tl.reshape(tl.sum(tl.reshape(acc[m][0], (NW, 32)), axis=0), (8, 4)), axis=1)
            hi = tl.max(tl.reshape(tl.sum(tl.reshape(acc[m][2], (NW, 32)), axis=0), (8, 4)), axis=1)
            y = y + (tl.reshape(tl.permute(tl.join(lo, hi), (1, 0)), (16,)),)
        if MT == 1:
            yt = y[0]
        else:
            yt = tl.reshape(tl.permute(tl.join(y[0], y[1]), (1, 0)), (BN,))
        offs_m = tl.arange(0, 16)
        tile = yt[:, None] + tl.zeros((BN, 16), dtype=tl.float32)
        store_out(tile, out_ptr, out_ptr, lcnt, pid_n, 0, 0, offs_m, offs_m < 1, 1, N, 1, tl.cdiv(N, BN), N,
                   lb0, lb1, lb2, ls0, ls1, ls2, lst1, lst2, lr, lt, lcnt, BN, 16, False, BR, LORA)  # fmt: skip
    stamp(stamp_ptr, tl.program_id(0), 1, STAMPS)


def warps_for(cfg: GemvConfig, n: int, k: int, sms: int) -> int:
    """Warps per program, each taking an equal run of K tiles (cfg.mma_tiles at a time): the fewest powers
    of two that give about cfg.programs_per_sm warps per SM over the N // block_n programs, at most cfg.num_warps,
    dividing the K tiles."""
    want = -(-cfg.programs_per_sm * sms // (n // cfg.block_n))
    tiles = k // TILE_K // cfg.mma_tiles
    nw = 1
    while nw < want and nw * 2 <= cfg.num_warps and tiles % (nw * 2) == 0:
        nw *= 2
    return nw


def gemv_mma(
    x: Tensor,
    w: PackedWeight,
    out: Tensor,
    cfg: GemvConfig,
    tickets,
    lora: LoraDelta | None = None,
    stamps: Tensor | None = None,
) -> Tensor:
    """out[1, N] = x[1, K] @ W^T (+ the LoRA deltas `lora`) for x bf16 on the GPU and `configs.mma_ok` weights;
    the arguments are gemv.gemv's."""
    n, k = w.n, w.k
    nw = warps_for(cfg, n, k, sm_count(x.device))
    n_tiles = n // cfg.block_n
    launch = launch_args(x, n, lora, 16, cfg.block_n, lambda: tickets(N_COUNTERS), n_tiles, stamps)
    pdl = use_pdl(x.device)
    _gemv_mma_kernel[(launch.rank_programs + n_tiles,)](
        x, w.values, w.scale, out, n, k, k // TILE_K // nw, w.values.stride(0), w.scale.stride(0), *launch.tail,
        GROUP=w.group, MT=cfg.block_n // 16, U=cfg.mma_tiles, HINT=_HINTS[cfg.l2_prefetch], NW=nw, PDL=pdl,
        launch_pdl=pdl, num_warps=nw, **launch.constexprs,
    )  # fmt: skip
    return out
