"""In-register decoders: turn one tile of a packed weight into float32 (or bf16) values.

Every kernel reads weights only through `load_scales` + `dequant_tile`, so forward, dX, decode and
grouped MoE see bit-identical dequantized values (the "one path" invariant). The tile is
W[rows, k0:k0+BK] in the weight's own [N, K] orientation; callers transpose it with tl.trans for W^T.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .formats import SCALE_GROUPS, TILE_K, TILE_ROWS

# 2**23 as fp32 bits: OR-ing a small integer c into the mantissa gives the float 2**23 + c exactly.
# Converting through this bit trick avoids the slow int->float conversion unit.
_MAGIC_BITS = tl.constexpr(0x4B000000)
_MAGIC_INT4 = tl.constexpr(8388616.0)  # 2**23 + 8: also removes the +8 offset of the stored nibble
# int4-tiled's blocks (formats.py): 16 rows of a K tile's words, or of SCALE_GROUPS scales (passed as the literal 8:
# the interpreter cannot take a scalar column % a global constexpr)
_TILE_ROWS = tl.constexpr(TILE_ROWS)
_WORDS_PER_BLOCK = tl.constexpr(TILE_K // 8)
assert SCALE_GROUPS == 8


@triton.jit
def element_offset(r, c, row_len, PER: tl.constexpr, TILED: tl.constexpr):
    """Offset of element (r, c) (broadcastable tensors) of an [N, row_len] packed tensor: row-major, or TILED in
    int4-tiled's blocks of 16 rows x PER columns (a K tile's 16 words, or 8 scale groups), each row after row, a row
    tile's blocks one after another (quant/formats/tiled.py)."""
    if TILED:
        off = ((r // _TILE_ROWS) * (_TILE_ROWS * row_len) + (c // PER) * (_TILE_ROWS * PER) + (r % _TILE_ROWS) * PER
               + c % PER)
    else:
        off = r * row_len + c
    return off


@triton.jit
def _load_words(w_ptr, rows, k0, N, n_words, stride_wn, ROWS: tl.constexpr, BK: tl.constexpr,
                PER: tl.constexpr, K_EVEN: tl.constexpr, TILED: tl.constexpr = False):
    """[ROWS, BK // PER] stored words holding W[rows, k0:k0+BK] (PER values each); 0 outside the matrix. TILED:
    int4 words in int4-tiled's layout (stride_wn is then the row-major row length, K / 8)."""
    cols = k0 // PER + tl.arange(0, BK // PER)
    if K_EVEN:  # no K mask: it would cap the vector width of the (async) loads
        mask = (rows[:, None] < N) & (cols[None, :] >= 0)
    else:
        mask = (rows[:, None] < N) & (cols[None, :] < n_words)
    return tl.load(w_ptr + element_offset(rows[:, None], cols[None, :], stride_wn, _WORDS_PER_BLOCK, TILED), mask=mask,
                   other=0)


@triton.jit
def _fields(words, ROWS: tl.constexpr, BK: tl.constexpr, PER: tl.constexpr, BITS: tl.constexpr,
            PAIRED: tl.constexpr = False):  # fmt: skip
    """int32 [ROWS, BK]: the BITS-wide fields of words [ROWS, BK // PER] (field j of a word at bits j*BITS; PAIRED:
    int4-tiled's nibble order, value j in nibble j // 2 + 4 (j % 2))."""
    j = tl.arange(0, PER)
    if PAIRED:
        shifts = (j // 2 + 4 * (j % 2)) * BITS
    else:
        shifts = j * BITS
    fields = (words.to(tl.int32)[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
    return tl.reshape(fields, (ROWS, BK))


@triton.jit
def _unpack(w_ptr, rows, k0, N, n_words, stride_wn, ROWS: tl.constexpr, BK: tl.constexpr,
            PER: tl.constexpr, BITS: tl.constexpr, K_EVEN: tl.constexpr):
    """int32 [ROWS, BK]: the fields of W[rows, k0:k0+BK], PER per stored word; 0 outside the matrix."""
    words = _load_words(w_ptr, rows, k0, N, n_words, stride_wn, ROWS, BK, PER, K_EVEN)
    return _fields(words, ROWS, BK, PER, BITS)


@triton.jit
def int4_values(words, ROWS: tl.constexpr, BK: tl.constexpr, PAIRED: tl.constexpr = False):
    """fp32 [ROWS, BK]: q = nibble - 8 of int4 words [ROWS, BK // 8] (stored as q + 8), in K order (PAIRED:
    words in int4-tiled's nibble order)."""
    return (_fields(words, ROWS, BK, 8, 4, PAIRED) | _MAGIC_BITS).to(tl.float32, bitcast=True) - _MAGIC_INT4


@triton.jit
def value_planes(o0, o1, o2, o3, o4, o5, o6, o7, PAIRED: tl.constexpr):
    """Eight nibble planes (oj: nibble j of each word) as value planes (value j of each word): the same tensors,
    renamed where PAIRED (int4-tiled's order, value j in nibble j // 2 + 4 (j % 2)). No data moves."""
    if PAIRED:
        out = (o0, o4, o1, o5, o2, o6, o3, o7)
    else:
        out = (o0, o1, o2, o3, o4, o5, o6, o7)
    return out


@triton.jit
def apply_scales(vals, scales, ROWS: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
    """vals [ROWS, BK] times load_scales' scales ([ROWS, BK // GROUP], or [ROWS, 1] inside one group)."""
    if BK >= GROUP:  # (one return per function: triton 3.6 compiles code after a constexpr-if's return)
        out = vals * _expand_groups(scales, ROWS, BK, GROUP)
    else:
        out = vals * scales
    return out


# int4 -> bf16 two values per instruction (GPU only: the interpreter cannot run PTX). OR-ing a nibble n
# into the mantissa of bf16 128.0 (0x4300) gives 128 + n exactly; lop3 does that for nibbles j and j+4
# of a word at once (they sit 16 bits apart), an fma subtracts 136 (exact: q = n - 8), and a second fma
# multiplies by the scale with one rounding: bit-identical to rounding the exact fp32 product q * s.
_INT4_BF16_ASM = tl.constexpr("""
{
.reg .b32 t0, t1, t2, t3, w, s2, one, off, nz;
mov.b32 s2, {$9, $9};
mov.b32 one, 0x3F803F80;
mov.b32 off, 0xC308C308;
mov.b32 nz, 0x80008000;
lop3.b32 t0, $8, 0x000F000F, 0x43004300, 0xEA;
shr.u32 w, $8, 4;
lop3.b32 t1, w, 0x000F000F, 0x43004300, 0xEA;
shr.u32 w, $8, 8;
lop3.b32 t2, w, 0x000F000F, 0x43004300, 0xEA;
shr.u32 w, $8, 12;
lop3.b32 t3, w, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 t0, t0, one, off;
fma.rn.bf16x2 t1, t1, one, off;
fma.rn.bf16x2 t2, t2, one, off;
fma.rn.bf16x2 t3, t3, one, off;
fma.rn.bf16x2 t0, t0, s2, nz;
fma.rn.bf16x2 t1, t1, s2, nz;
fma.rn.bf16x2 t2, t2, s2, nz;
fma.rn.bf16x2 t3, t3, s2, nz;
mov.b32 {$0, $4}, t0;
mov.b32 {$1, $5}, t1;
mov.b32 {$2, $6}, t2;
mov.b32 {$3, $7}, t3;
}
""")


@triton.jit
def _int4_to_bf16(words, word_scales, ROWS: tl.constexpr, BK: tl.constexpr, PAIRED: tl.constexpr = False):
    """words: int32 [ROWS, BK // 8] of 8 nibbles (PAIRED: int4-tiled's order); word_scales: bf16 [ROWS, BK // 8]
    -> bf16 [ROWS, BK]."""
    o0, o1, o2, o3, o4, o5, o6, o7 = _int4_words_to_bf16(words, word_scales)
    return _nibbles_to_tile(o0, o1, o2, o3, o4, o5, o6, o7, ROWS, BK, PAIRED)


@triton.jit
def _e2m1_to_f32(code):
    """fp4 e2m1 codes (int32, 0..15) -> float32, built from bits: 0, .5, 1, 1.5, 2, 3, 4, 6 and signs."""
    mag = code & 7
    exp = mag >> 1
    man = mag & 1
    normal = ((exp + 126) << 23) | (man << 22)  # 2^(exp-1) * (1 + man/2)
    subnormal = man * 0x3F000000  # exp == 0: man * 0.5
    bits = tl.where(exp > 0, normal, subnormal) | ((code & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _expand_groups(s, ROWS: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
    """[ROWS, BK // GROUP] per-group scales -> [ROWS, BK] (each repeated GROUP times)."""
    s3 = tl.broadcast_to(s[:, :, None], (ROWS, BK // GROUP, GROUP))
    return tl.reshape(s3, (ROWS, BK))


@triton.jit
def load_scales(s_ptr, rows, k0, n_rows, n_groups, stride_sn, gscale, FMT: tl.constexpr,
                ROWS: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr, K_EVEN: tl.constexpr):
    """float32 scales of the tile W[rows, k0:k0+BK]: [ROWS, BK // GROUP], or [ROWS, 1] when the tile lies
    inside one group. Zero for rows >= n_rows (N, or 0 for a prefetch past the end) and past K, which
    also zeroes the weights they multiply. gscale: nvfp4's per-matrix scale (else unused).

    rows: int [ROWS] row (N) indices; k0 is a multiple of BK, and BK and GROUP are powers of two, so a
    tile holds whole scale groups (BK >= GROUP) or lies inside one group (BK < GROUP). FMT INT4_TILED: the scales
    in int4-tiled's blocks (stride_sn is the row-major row length, n_groups).
    """
    if FMT == 4:  # plain weights carry no scales: a constant the decoder never reads
        s = tl.full((ROWS, 1), 1.0, tl.float32)
    else:
        row_ok = rows < n_rows
        if FMT == 1:  # fp8 128x128 blocks: 128 rows share a scale row
            srows = rows // 128
        else:
            srows = rows
        if BK >= GROUP:
            g = k0 // GROUP + tl.arange(0, BK // GROUP)
            if K_EVEN:
                smask = row_ok[:, None] & (g[None, :] >= 0)
            else:
                smask = row_ok[:, None] & (g[None, :] < n_groups)
            s = tl.load(s_ptr + element_offset(srows[:, None], g[None, :], stride_sn, 8, FMT == 5),
                        mask=smask)
        else:
            smask = row_ok[:, None]
            s = tl.load(s_ptr + element_offset(srows, k0 // GROUP, stride_sn, 8, FMT == 5),
                        mask=row_ok)[:, None]
        if FMT == 2:  # e8m0 exponent byte -> 2^(e-127) as fp32 bits (e = 0 decodes to 0, e = 255 to inf)
            s = (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        elif FMT == 3:  # fp8 block scale times the per-matrix fp32 global scale
            s = s.to(tl.float32) * gscale
        else:
            s = s.to(tl.float32)
        # fp8 loads take no `other=`, so masked lanes are zeroed here.
        s = tl.where(smask, s, 0.0)
    return s


@triton.jit
def dequant_tile(w_ptr, scales, rows, k0, N, K, stride_wn, FMT: tl.constexpr, ROWS: tl.constexpr,
                 BK: tl.constexpr, GROUP: tl.constexpr, K_EVEN: tl.constexpr, FAST_INT4: tl.constexpr):
    """[ROWS, BK] = W[rows, k0:k0+BK], zero outside the matrix; `scales` from load_scales.

    float32, or bf16 when FAST_INT4 (int4 only, GPU only): both give the same bf16 values.
    FMT is one of formats.INT4 / FP8 / MXFP4 / NVFP4 / PLAIN (stored dtype) / INT4_TILED. K_EVEN: K % BK == 0, so no
    tile crosses K.
    """
    if FMT == 4:  # plain (unquantized) weight: loaded as stored, so the tile loop serves bf16 matmuls too
        cols = k0 + tl.arange(0, BK)
        if K_EVEN:
            mask = (rows[:, None] < N) & (cols[None, :] >= 0)
        else:
            mask = (rows[:, None] < N) & (cols[None, :] < K)
        w = tl.load(w_ptr + rows[:, None] * stride_wn + cols[None, :], mask=mask, other=0.0)
    elif FAST_INT4:
        words = _load_words(w_ptr, rows, k0, N, K // 8, stride_wn, ROWS, BK, 8, K_EVEN, FMT == 5)
        if BK >= GROUP:  # one scale per word (a word's 8 values never straddle a group)
            word_scales = _expand_groups(scales, ROWS, BK // 8, GROUP // 8)
        else:
            word_scales = tl.broadcast_to(scales, (ROWS, BK // 8))
        w = _int4_to_bf16(words, word_scales.to(tl.bfloat16), ROWS, BK, FMT == 5)
    else:
        if FMT == 0 or FMT == 5:  # int4 (row-major or tiled): q + 8 in 4-bit fields, 8 per int32
            words = _load_words(w_ptr, rows, k0, N, K // 8, stride_wn, ROWS, BK, 8, K_EVEN, FMT == 5)
            vals = int4_values(words, ROWS, BK, FMT == 5)
        elif FMT == 1:  # fp8 e4m3
            cols = k0 + tl.arange(0, BK)
            if K_EVEN:
                mask = (rows[:, None] < N) & (cols[None, :] >= 0)
            else:
                mask = (rows[:, None] < N) & (cols[None, :] < K)
            # (no `other=` for fp8 pointers; zero the masked lanes after the conversion instead)
            vals = tl.load(w_ptr + rows[:, None] * stride_wn + cols[None, :], mask=mask).to(tl.float32)
            vals = tl.where(mask, vals, 0.0)
        else:  # mxfp4 / nvfp4: e2m1 codes, low nibble first
            vals = _e2m1_to_f32(_unpack(w_ptr, rows, k0, N, K // 2, stride_wn, ROWS, BK, 2, 4, K_EVEN))
        w = apply_scales(vals, scales, ROWS, BK, GROUP)
    return w


@triton.jit
def load_word_scales(s_ptr, rows, k0, N, n_groups, stride_sn, ROWS: tl.constexpr, BK: tl.constexpr,
                     GROUP: tl.constexpr, K_EVEN: tl.constexpr, TILED: tl.constexpr = False):
    """int4 only: the bf16 scale of every stored word of W[rows, k0:k0+BK], as [ROWS, BK // 8] (0 for rows
    >= N and past K): the values load_scales + _expand_groups give, rounded to bf16 (exact, int4 scales
    are bf16). For kernels whose threads own single words (4-byte word loads): the addresses repeat along
    K, so the compiler orders the load by rows first; it is issued as [BK // 8, ROWS] and transposed,
    which puts it in the register layout of the words themselves. TILED: int4-tiled's scales."""
    wc = k0 // 8 + tl.arange(0, BK // 8)
    g = wc // (GROUP // 8)  # GROUP >= 8: a word's 8 values share one group
    if K_EVEN:
        mask = (rows[None, :] < N) & (g[:, None] >= 0)
    else:
        mask = (rows[None, :] < N) & (g[:, None] < n_groups)
    s = tl.load(s_ptr + element_offset(rows[None, :], g[:, None], stride_sn, 8, TILED), mask=mask,
                other=0.0)
    return tl.trans(s).to(tl.bfloat16)


@triton.jit
def _int4_words_to_bf16(words, word_scales):
    """The eight nibbles of each int32 word as bf16 (GPU only): a tuple o0..o7 of tensors shaped like
    `words`, oj = (nibble j - 8) * scale rounded to bf16, the values _int4_to_bf16 returns before its
    interleave (callers that may permute K, like a dot product, use them in any consistent order)."""
    return tl.inline_asm_elementwise(
        _INT4_BF16_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [words, word_scales],
        dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16,
               tl.bfloat16),
        is_pure=True, pack=1)


# The same decode as _INT4_BF16_ASM (its text up to the final moves), then each bf16 value widened to
# fp32 (its bits in the high half): a shift for nibbles 0-3 (low halves) and a mask for 4-7. One
# instruction per value, where a generic bf16 -> fp32 conversion of an unpacked pair costs three.
_INT4_F32_ASM = tl.constexpr(
    _INT4_BF16_ASM.value.split("mov.b32 {$0, $4}")[0]
    + "".join(f"shl.b32 ${j}, t{j}, 16;\nand.b32 ${j + 4}, t{j}, 0xFFFF0000;\n" for j in range(4))
    + "}\n"
)


@triton.jit
def _int4_words_to_f32(words, word_scales):
    """_int4_words_to_bf16's eight nibble planes, widened to fp32 (exactly: same values)."""
    return tl.inline_asm_elementwise(
        _INT4_F32_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,h", [words, word_scales],
        dtype=(tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32,
               tl.float32),
        is_pure=True, pack=1)


@triton.jit
def _nibbles_to_tile(o0, o1, o2, o3, o4, o5, o6, o7, ROWS: tl.constexpr, BK: tl.constexpr,
                     PAIRED: tl.constexpr = False):  # fmt: skip
    """Eight nibble planes [ROWS, BK // 8] (oj = nibble j of each word; PAIRED: int4-tiled's order) -> the tile
    [ROWS, BK] in K order (in registers: each thread keeps its words' values)."""
    v0, v1, v2, v3, v4, v5, v6, v7 = value_planes(o0, o1, o2, o3, o4, o5, o6, o7, PAIRED)
    # Interleave so that value j of word c lands at column 8c + j: join adds a minor dim, so pairing
    # (j, j+4), then (j, j+2), then (j, j+1) yields dims (d1, d2, d3) holding value 4*d1 + 2*d2 + d3.
    lo = tl.join(tl.join(v0, v4), tl.join(v2, v6))
    hi = tl.join(tl.join(v1, v5), tl.join(v3, v7))
    return tl.reshape(tl.join(lo, hi), (ROWS, BK))
