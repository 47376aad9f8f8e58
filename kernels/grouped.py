"""Grouped MoE GEMM over active experts, forward and dX, on stacked packed expert weights.

Rows are sorted by expert; expert e owns rows expert_offsets[e]:expert_offsets[e+1]. The row tiles of the
experts that got tokens are numbered in expert order, and program (t, P tile) finds its tile t's expert and
first row from the offsets itself (`_find_tile`), so weights of experts without tokens are never read and no
tile map is built first (one took ~15 small torch launches per call, most of a MoE decode step's glue:
bench/RESULTS.md). Transient memory is one register tile per program, whatever the number of experts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .configs import TileConfig, max_row_tiles, pick_config
from .formats import PackedWeight
from .gemm import check_activation, dot_precision, fast_int4, k_even, tile_mainloop, tile_ptrs


@triton.jit
def _find_tile(offsets_ptr, t, num_experts, BM: tl.constexpr, E_POW2: tl.constexpr):
    """(expert, first row, end of the expert's rows) of row tile t, the experts' BM-row tiles numbered in expert
    order (experts without rows have none); expert >= num_experts for t past the last tile."""
    e = tl.arange(0, E_POW2)
    ok = e < num_experts
    lo = tl.load(offsets_ptr + e, mask=ok, other=0)
    hi = tl.load(offsets_ptr + e + 1, mask=ok, other=0)
    tiles = (hi - lo + BM - 1) // BM
    ends = tl.cumsum(tiles, 0)  # one past each expert's last tile
    expert = tl.sum((ends <= t).to(tl.int32), 0)
    mine = e == expert
    first = tl.sum(tl.where(mine, lo + (t - ends + tiles) * BM, 0), 0)
    return expert, first, tl.sum(tl.where(mine, hi, 0), 0)


@triton.jit
def _grouped_kernel(a_ptr, w_ptr, s_ptr, gs_ptr, out_ptr, offsets_ptr,
                    P, R, N, K, n_groups, num_experts,
                    stride_am, stride_ar, stride_we, stride_wn, stride_se, stride_sn, stride_om, stride_op,
                    FMT: tl.constexpr, GROUP: tl.constexpr, DX: tl.constexpr, SWAP: tl.constexpr,
                    BM: tl.constexpr, BP: tl.constexpr, BR: tl.constexpr, PREC: tl.constexpr,
                    K_EVEN: tl.constexpr, FAST_INT4: tl.constexpr, E_POW2: tl.constexpr):
    # P tiles vary fastest: the programs of one row tile run together and share its activations in L2,
    # and the next row tiles of the same expert then find that expert's weight tiles in L2.
    pid = tl.program_id(0)
    num_p = tl.cdiv(P, BP)
    t = pid // num_p
    pid_p = pid % num_p
    e, first_row, row_end = _find_tile(offsets_ptr, t, num_experts, BM, E_POW2)
    if e < num_experts:  # the grid's spare tiles do nothing
        offs_m = first_row.to(tl.int64) + tl.arange(0, BM)
        m_ok = offs_m < row_end
        e64 = e.to(tl.int64)
        acc = tile_mainloop(a_ptr, stride_am, stride_ar, offs_m, m_ok,
                            w_ptr + e64 * stride_we, s_ptr + e64 * stride_se, gs_ptr + e,
                            stride_wn, stride_sn, pid_p * BP, 0, R, R, N, K, n_groups,
                            FMT, GROUP, DX, SWAP, BM, BP, BR, PREC, K_EVEN, FAST_INT4)
        offs_p = pid_p * BP + tl.arange(0, BP)
        ptrs, mask = tile_ptrs(out_ptr, offs_m, offs_p, m_ok, P, stride_om, stride_op, SWAP)
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def check_offsets(expert_offsets: Tensor, w: PackedWeight, device: torch.device) -> None:
    if expert_offsets.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"expert_offsets must be int32 or int64, got {expert_offsets.dtype}")
    if expert_offsets.dim() != 1 or expert_offsets.numel() != w.experts + 1:
        raise ValueError(
            f"expert_offsets must be [E+1] = [{w.experts + 1}] (start of each expert's rows, then the end), "
            f"got shape {tuple(expert_offsets.shape)}"
        )
    if expert_offsets.device != device:
        raise ValueError(f"expert_offsets is on {expert_offsets.device} but the activations are on {device}")


def check_grouped(a: Tensor, expert_offsets: Tensor, w: PackedWeight, dx: bool) -> None:
    """grouped_gemm's argument checks (shared by the decode kernel, grouped_mma.py)."""
    if w.experts is None:
        raise ValueError("grouped_gemm needs stacked expert weights [E, N, ...]; use dense_gemm for 2-D ones")
    check_activation(a, w, dx, "dy_sorted" if dx else "x_sorted")
    check_offsets(expert_offsets, w, a.device)
    if a.dim() != 2:
        raise ValueError(f"grouped inputs must be 2-D [tokens, features], got shape {tuple(a.shape)}")


def grouped_gemm(a: Tensor, expert_offsets: Tensor, w: PackedWeight, dx: bool,
                 config: TileConfig | None = None) -> Tensor:
    """Per expert e: out[rows_e] = a[rows_e] @ W_e^T (forward) or a[rows_e] @ W_e (dx=True).

    a: [T, K] (forward) or [T, N] (dX), rows sorted by expert; expert_offsets: int [E+1] with
    expert_offsets[0] = 0 and expert_offsets[E] = T (not checked: that would need a host sync; rows
    outside the offsets are left unwritten). Returns [T, N] or [T, K] in a.dtype.
    """
    check_grouped(a, expert_offsets, w, dx)
    t, r = a.shape
    p = w.k if dx else w.n
    out = torch.empty((t, p), dtype=a.dtype, device=a.device)
    if t == 0:
        return out
    kind = "grouped_dx" if dx else "grouped_fwd"
    cfg = config or pick_config(kind, -(-t // w.experts), a.device, a.dtype)
    if cfg.split_k > 1:
        raise ValueError("grouped_gemm does not split the reduction; use a TileConfig with split_k=1")
    max_tiles = max_row_tiles(t, cfg.block_m, w.experts)
    num_p = triton.cdiv(p, cfg.block_p)
    gs = w.global_scale if w.global_scale is not None else w.scale
    _grouped_kernel[(max_tiles * num_p,)](
        a, w.values, w.scale, gs, out, expert_offsets,
        p, r, w.n, w.k, w.scale.shape[-1], w.experts,
        a.stride(0), a.stride(1), w.values.stride(0), w.values.stride(1),
        w.scale.stride(0), w.scale.stride(1), out.stride(0), out.stride(1),
        FMT=w.fmt.code, GROUP=w.group, DX=dx, SWAP=cfg.swap_ab, BM=cfg.block_m, BP=cfg.block_p,
        BR=cfg.block_r, PREC=dot_precision(a.dtype), K_EVEN=k_even(w, cfg, dx), FAST_INT4=fast_int4(w, a.dtype),
        E_POW2=triton.next_power_of_2(w.experts), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
