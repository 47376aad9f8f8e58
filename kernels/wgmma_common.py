"""Pieces the warpgroup-MMA kernels (wgmma_int4.py's forward, wgmma_int4_dx.py's dX) share: the TMA load and
descriptors (of row-major and int4-tiled packed tensors), a grouped program's tile lookup, and the epilogue that
stores a tile (or sums its K splits)."""

from __future__ import annotations

import functools

from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .formats import TILE_ROWS

# Triton 3.9 renamed the TMA load, the CTA barrier and shared memory's reinterpret (3.6, on the GPU machine, has only
# the old names).
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
_PUBLIC_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))
_TILE_ROWS = gl.constexpr(TILE_ROWS)


@functools.cache
def smem_layout(block: tuple[int, ...], dtype: str) -> gl.NVMMASharedLayout:
    """The TMA tiles' shared-memory layout (the same per tile shape; built once, not on every decode launch)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), {"bf16": gl.bfloat16, "int32": gl.int32}[dtype])


def tma_desc(t: Tensor, block: list[int], dtype: str) -> TensorDescriptor:
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, smem_layout(tuple(block), dtype))


def packed_desc(t: Tensor, block: list[int], dtype: str, per: int, tiled: bool) -> TensorDescriptor:
    """tma_desc of a packed tensor t [rows, C] (words or scales), boxes `block` [box rows, box columns]; tiled: t in
    int4-tiled's blocks of 16 rows x `per` columns, described as the 4-D [rows / 16, C / per, 16, per] with boxes
    [box rows / 16, 1, 16, box columns] (a box's columns inside one block): such a box lands in shared memory as the
    row-major box does, the same bytes in the same swizzle, for the kernels read them as that (tma_load_rows)."""
    if not tiled:
        return tma_desc(t, block, dtype)
    rows, cols = t.shape
    view = t.view(rows // TILE_ROWS, cols // per, TILE_ROWS, per)
    box = (block[0] // TILE_ROWS, 1, TILE_ROWS, block[1])
    return TensorDescriptor(view, list(view.shape), list(view.stride()), list(box), smem_layout(box, dtype))


@gluon.jit
def tma_load_rows(desc, row, col, barrier, dest, PER: gl.constexpr, TILED: gl.constexpr):
    """TMA of packed_desc's box at (row, col) of the 2-D tensor into dest (a 2-D buffer of the box's shape); TILED:
    from int4-tiled's 4-D view (row a multiple of 16, the box's columns inside one block of PER)."""
    if TILED:
        if _PUBLIC_REINTERPRET:
            tiles = dest.reinterpret(dest.dtype, desc.block_type.shape, desc.layout)
        else:
            tiles = dest._reinterpret(dest.dtype, desc.block_type.shape, desc.layout)
        tma_load(desc, [row // _TILE_ROWS, col // PER, 0, col % PER], barrier, tiles)
    else:
        tma_load(desc, [row, col], barrier, dest)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def find_tile(offsets_ptr, t, num_experts, BM: gl.constexpr, E_POW2: gl.constexpr, num_warps: gl.constexpr):
    """grouped.py's _find_tile: (expert, first row, end of the expert's rows) of row tile t, the experts' BM-row
    tiles numbered in expert order; expert = num_experts for t past the last tile. (An associative scan for the
    cumulative sum: Triton 3.6's Gluon has no cumsum.)"""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    e = gl.arange(0, E_POW2, layout=layout)
    ok = e < num_experts
    lo = gl.load(offsets_ptr + e, mask=ok, other=0)
    hi = gl.load(offsets_ptr + e + 1, mask=ok, other=0)
    tiles = (hi - lo + BM - 1) // BM
    ends = gl.associative_scan(tiles, 0, _add)  # one past each expert's last tile
    expert = gl.sum((ends <= t).to(gl.int32), 0)
    mine = e == expert
    first = gl.sum(gl.where(mine, lo + (t - ends + tiles) * BM, 0), 0)
    return expert, first, gl.sum(gl.where(mine, hi, 0), 0)


@gluon.jit
def store_block(acc, out_ptr, ws_ptr, cnt_ptr, pid_n, n_lo, split, m_lo, m_end, M, N, n_splits, stride_om,
                BN: gl.constexpr, BM: gl.constexpr, SPLIT: gl.constexpr, ROW_PERM: gl.constexpr,
                num_warps: gl.constexpr):
    """out[m_lo + j, n_lo + i] = acc[i, j] (bf16) for rows below m_end and columns below N; with SPLIT, this split's
    fp32 partials, and the last split of tile pid_n to arrive sums them all in split order. ROW_PERM: acc's row i
    holds column n_lo + wgmma_int4_dx.row_column(i) (the dX kernel's row order)."""
    # The tile leaves through shared memory into a layout with 4 consecutive n per thread: out and the partials
    # are [M, N] row-major, so n is the contiguous side of the transposed tile.
    io_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[4, 1], threads_per_warp=[BN // 4, 128 // BN],
                                               warps_per_cta=[1, num_warps], order=[0, 1])
    acc = gl.convert_layout(acc, io_layout)
    rows = gl.arange(0, BN, layout=gl.SliceLayout(1, io_layout))
    if ROW_PERM:  # (4 consecutive rows stay 4 consecutive columns: the stores stay 8-byte vectors)
        rows = 8 * (2 * (rows // 16) + rows % 8 // 4) + 4 * (rows // 8 % 2) + rows % 4
    ns = n_lo + rows
    ms = m_lo + gl.arange(0, BM, layout=gl.SliceLayout(0, io_layout))
    mask = gl.expand_dims(ns < N, 1) & gl.expand_dims(ms < m_end, 0)
    out_offs = gl.expand_dims(ms * stride_om, 0) + gl.expand_dims(ns, 1)
    if SPLIT:
        # Partials in ws [n_splits, M, N] fp32 (int32 offsets: the host checks n_splits * M * N < 2**31).
        part_offs = gl.expand_dims(ms * N, 0) + gl.expand_dims(ns, 1)
        gl.store(ws_ptr + split * M * N + part_offs, acc, mask=mask)
        cta_barrier()
        tile_id = gl.program_id(2) * gl.num_programs(0) + pid_n
        ticket = gl.atomic_add(cnt_ptr + tile_id, 1, sem="acq_rel")
        if ticket == n_splits - 1:
            total = gl.zeros([BN, BM], gl.float32, io_layout)
            for t in range(n_splits):  # fixed order: the sum does not depend on arrival order
                total += gl.load(ws_ptr + t * M * N + part_offs, mask=mask, other=0.0, cache_modifier=".cg")
            gl.store(out_ptr + out_offs, total.to(gl.bfloat16), mask=mask)
            gl.atomic_xchg(cnt_ptr + tile_id, 0)
    else:
        gl.store(out_ptr + out_offs, acc.to(gl.bfloat16), mask=mask)
