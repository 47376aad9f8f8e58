"""The per-lane mma GEMV's PTX (gemv_mma.py) emulated for Triton's interpreter, so that gemv_mma.py's and
grouped_mma.py's kernels run in CPU tests: their addressing, K splits over warps, row masks and epilogues.

Every function returns what its PTX counterpart leaves in each lane's registers, for the same lane layout: lane
(g, t) of a warp holds words of weight rows g and g + 8 at K 32t..32t+31 of the tile (with word pairs, K 16t..16t+15
and 64 on), and activations of row g (+ 8 per n8 tile) there. The mma is a warp-wide exchange, emulated by
regrouping the lanes' values per warp. The weights decode to the same bf16 values (the product of a nibble and a
bf16 scale is exact in fp32 and rounds once to nearest even, by integer arithmetic here, since the interpreter's bf16
casts truncate); the fp32 sums run in another order than the tensor cores'. Scales travel as fp32 bit patterns, not
bf16.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _probe():
    pass


# Kernels decorated while TRITON_INTERPRET=1 was set run on the CPU through Triton's interpreter (the one place the
# package asks; every kernel module was decorated in the same process state).
INTERPRETED = type(_probe).__name__ == "InterpretedFunction"


@triton.jit
def _ptr(addr, dtype: tl.constexpr):
    return addr.to(tl.pointer_type(dtype), bitcast=True)


@triton.jit
def load_w_rows(row_g, row_g8, scale_g, scale_g8, PAIRS: tl.constexpr, GROUP: tl.constexpr):
    """gemv_mma._load_w_rows: 4 words of row g and 4 of row g + 8 (byte addresses row_g, row_g8: words 0-3 there, or
    with PAIRS words 0, 1, 8, 9), then their scales' fp32 bit patterns (bf16 at scale_g, scale_g8; with PAIRS those
    addresses hold the K tile's first group, and each row's two pairs of words take groups 16t // GROUP and
    (64 + 16t) // GROUP of the tile)."""
    g = _ptr(row_g, tl.int32)
    h = _ptr(row_g8, tl.int32)
    if PAIRS:
        t = tl.arange(0, row_g.shape[0]) % 4
        lo, hi = 2 * ((16 * t) // GROUP), 2 * ((64 + 16 * t) // GROUP)
        return (tl.load(g), tl.load(g + 1), tl.load(g + 8), tl.load(g + 9), tl.load(h), tl.load(h + 1),
                tl.load(h + 8), tl.load(h + 9), _scale_bits(scale_g + lo), _scale_bits(scale_g + hi),
                _scale_bits(scale_g8 + lo), _scale_bits(scale_g8 + hi))  # fmt: skip
    return (tl.load(g), tl.load(g + 1), tl.load(g + 2), tl.load(g + 3), tl.load(h), tl.load(h + 1), tl.load(h + 2),
            tl.load(h + 3), _scale_bits(scale_g), _scale_bits(scale_g8))  # fmt: skip


@triton.jit
def _scale_bits(addr):
    """The fp32 bit pattern of the bf16 at byte address addr."""
    return (tl.load(_ptr(addr, tl.int16)).to(tl.int32) & 0xFFFF) << 16


@triton.jit
def load_x(addr, PAIRS: tl.constexpr):
    """gemv_mma._load_x: the 16 words (bf16 pairs) from byte address addr: 64 contiguous bytes, or with PAIRS 32 at
    addr and 32 at addr + 128."""
    p = _ptr(addr, tl.int32)
    out = ()
    for i in tl.static_range(16):
        if PAIRS:
            out = out + (tl.load(p + i + 24 * (i // 8)),)
        else:
            out = out + (tl.load(p + i),)
    return out


@triton.jit
def _bf16_round(x):
    """fp32 -> the nearest bf16 (ties to even), as fp32."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _weights(w, first: tl.constexpr, scale_bits, scale_bits2, PAIRED: tl.constexpr):
    """A lane's 32 decoded weights of one row (words w[first:first + 4]; the last two scaled by scale_bits2), in K
    order, as fp32. PAIRED: int4-tiled's nibble order (value i of a word in nibble i // 2 + 4 (i % 2))."""
    out = ()
    for q in tl.static_range(4):
        scale = (scale_bits if q < 2 else scale_bits2).to(tl.float32, bitcast=True)
        for i in tl.static_range(8):
            nibble = ((w[first + q] >> (4 * (i // 2 + 4 * (i % 2) if PAIRED else i))) & 0xF) - 8
            out = out + (_bf16_round(nibble.to(tl.float32) * scale),)
    return out


@triton.jit
def _activations(x):
    """A lane's 32 activations (16 bf16 pairs) in K order, as fp32."""
    out = ()
    for m in tl.static_range(16):
        out = out + ((x[m] << 16).to(tl.float32, bitcast=True), (x[m] & -65536).to(tl.float32, bitcast=True))
    return out


@triton.jit
def _stack32(v):
    """32 lane tensors [L] -> [L, 32] (the values in bit-reversed order, the same for every call)."""
    a = ()
    for i in tl.static_range(16):
        a = a + (tl.join(v[2 * i], v[2 * i + 1]),)
    b = ()
    for i in tl.static_range(8):
        b = b + (tl.join(a[2 * i], a[2 * i + 1]),)
    c = ()
    for i in tl.static_range(4):
        c = c + (tl.join(b[2 * i], b[2 * i + 1]),)
    d = tl.join(tl.join(c[0], c[1]), tl.join(c[2], c[3]))
    return tl.reshape(d, (v[0].shape[0], 32))


@triton.jit
def _mma(w_rows, x_cols):
    """[L, 32] weights of each lane's row and [L, 32] activations of each lane's column -> (D[g][2t], D[g][2t + 1])
    per lane (g, t), D[r][c] the warp's dot product of row r's and column c's 128 K values."""
    L: tl.constexpr = w_rows.shape[0]
    NW: tl.constexpr = L // 32
    wr = tl.reshape(w_rows, (NW, 8, 1, 4, 32))
    xc = tl.reshape(x_cols, (NW, 1, 8, 4, 32))
    d = tl.sum(tl.sum(wr * xc, 4), 3)  # [NW, 8 rows, 8 columns]
    even, odd = tl.split(tl.reshape(d, (NW, 8, 4, 2)))
    return tl.reshape(even, (L,)), tl.reshape(odd, (L,))


@triton.jit
def tile(w, x, acc, NT: tl.constexpr, PAIRS: tl.constexpr, PAIRED: tl.constexpr):
    """gemv_mma._tile: acc (4 NT fp32 per lane) + one row tile x one K tile; w: load_w_rows' 10 (12 with PAIRS), x: NT
    load_x's 16; PAIRED: words in int4-tiled's nibble order."""
    if PAIRS:
        row_g = _stack32(_weights(w, 0, w[8], w[9], PAIRED))
        row_g8 = _stack32(_weights(w, 4, w[10], w[11], PAIRED))
    else:
        row_g = _stack32(_weights(w, 0, w[8], w[8], PAIRED))
        row_g8 = _stack32(_weights(w, 4, w[9], w[9], PAIRED))
    out = ()
    for j in tl.static_range(NT):
        cols = _stack32(_activations(x[j]))
        c0, c1 = _mma(row_g, cols)
        c2, c3 = _mma(row_g8, cols)
        out = out + (acc[4 * j] + c0, acc[4 * j + 1] + c1, acc[4 * j + 2] + c2, acc[4 * j + 3] + c3)
    return out
