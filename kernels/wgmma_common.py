"""Pieces the warpgroup-MMA kernels (wgmma_int4.py's forward, wgmma_int4_dx.py's dX) share: the TMA load and
descriptors, a grouped program's tile lookup, and the epilogue that stores a tile (or sums its K splits)."""

from __future__ import annotations

import functools

from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# Triton 3.9 renamed the TMA load and the CTA barrier (3.6, on the GPU machine, has only the old names).
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


@functools.cache
def _smem_layout(rows: int, cols: int, dtype: str) -> gl.NVMMASharedLayout:
    """The TMA tiles' shared-memory layout (the same per tile shape; built once, not on every decode launch)."""
    return gl.NVMMASharedLayout.get_default_for([rows, cols], {"bf16": gl.bfloat16, "int32": gl.int32}[dtype])


def tma_desc(t: Tensor, block: list[int], dtype: str) -> TensorDescriptor:
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, _smem_layout(*block, dtype))


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
