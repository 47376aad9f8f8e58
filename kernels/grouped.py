"""Grouped MoE GEMM over active experts, forward and dX, on stacked packed expert weights.

Rows are sorted by expert; expert e owns rows expert_offsets[e]:expert_offsets[e+1]. A tile map
(built on the device, no host sync) lists one entry per (expert, BM-row tile) of the experts that got
tokens, so a program handles (expert, M tile, P tile) and weights of experts without tokens are never
read. Transient memory is one register tile per program, whatever the number of experts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .configs import TileConfig, pick_config
from .formats import PackedWeight
from .gemm import check_activation, dot_precision, fast_int4, k_even, tile_mainloop, tile_ptrs


@triton.jit
def _grouped_kernel(a_ptr, w_ptr, s_ptr, gs_ptr, out_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr,
                    P, R, N, K, n_groups, num_experts,
                    stride_am, stride_ar, stride_we, stride_wn, stride_se, stride_sn, stride_om, stride_op,
                    FMT: tl.constexpr, GROUP: tl.constexpr, DX: tl.constexpr, SWAP: tl.constexpr,
                    BM: tl.constexpr, BP: tl.constexpr, BR: tl.constexpr, PREC: tl.constexpr,
                    K_EVEN: tl.constexpr, FAST_INT4: tl.constexpr):
    # P tiles vary fastest: the programs of one row tile run together and share its activations in L2,
    # and the next row tiles of the same expert then find that expert's weight tiles in L2.
    pid = tl.program_id(0)
    num_p = tl.cdiv(P, BP)
    t = pid // num_p
    pid_p = pid % num_p
    e = tl.load(tile_expert_ptr + t)
    if e < num_experts:  # padding entries of the tile map do nothing
        row0 = tl.load(tile_row_ptr + t).to(tl.int64)
        row_end = tl.load(offsets_ptr + e + 1)
        offs_m = row0 + tl.arange(0, BM)
        m_ok = offs_m < row_end
        e64 = e.to(tl.int64)
        acc = tile_mainloop(a_ptr, stride_am, stride_ar, offs_m, m_ok,
                            w_ptr + e64 * stride_we, s_ptr + e64 * stride_se, gs_ptr + e,
                            stride_wn, stride_sn, pid_p * BP, 0, R, R, N, K, n_groups,
                            FMT, GROUP, DX, SWAP, BM, BP, BR, PREC, K_EVEN, FAST_INT4)
        offs_p = pid_p * BP + tl.arange(0, BP)
        ptrs, mask = tile_ptrs(out_ptr, offs_m, offs_p, m_ok, P, stride_om, stride_op, SWAP)
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def tile_map(expert_offsets: Tensor, block_m: int, max_tiles: int) -> tuple[Tensor, Tensor]:
    """Per row-tile slot t < max_tiles: (expert, first row); padding slots get expert = E.

    expert_offsets: int [E+1] on the device. Returns int32 [max_tiles] x 2, computed without a sync.
    """
    num_experts = expert_offsets.numel() - 1
    offsets = expert_offsets.to(torch.int64)
    tiles = (offsets[1:] - offsets[:-1] + block_m - 1) // block_m  # [E] row tiles per expert
    ends = torch.cumsum(tiles, 0)  # [E] one past each expert's last tile id
    slot = torch.arange(max_tiles, device=offsets.device)
    expert = torch.searchsorted(ends, slot, right=True)  # [T] E for slots past the last tile
    owner = expert.clamp(max=num_experts - 1)
    first_row = offsets[owner] + (slot - (ends - tiles)[owner]) * block_m
    return expert.to(torch.int32), first_row.to(torch.int32)


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


def grouped_gemm(a: Tensor, expert_offsets: Tensor, w: PackedWeight, dx: bool,
                 config: TileConfig | None = None) -> Tensor:
    """Per expert e: out[rows_e] = a[rows_e] @ W_e^T (forward) or a[rows_e] @ W_e (dx=True).

    a: [T, K] (forward) or [T, N] (dX), rows sorted by expert; expert_offsets: int [E+1] with
    expert_offsets[0] = 0 and expert_offsets[E] = T (not checked: that would need a host sync; rows
    outside the offsets are left unwritten). Returns [T, N] or [T, K] in a.dtype.
    """
    if w.experts is None:
        raise ValueError("grouped_gemm needs stacked expert weights [E, N, ...]; use dense_gemm for 2-D ones")
    check_activation(a, w, dx, "dy_sorted" if dx else "x_sorted")
    check_offsets(expert_offsets, w, a.device)
    if a.dim() != 2:
        raise ValueError(f"grouped inputs must be 2-D [tokens, features], got shape {tuple(a.shape)}")
    t, r = a.shape
    p = w.k if dx else w.n
    out = torch.empty((t, p), dtype=a.dtype, device=a.device)
    if t == 0:
        return out
    kind = "grouped_dx" if dx else "grouped_fwd"
    cfg = config or pick_config(kind, -(-t // w.experts), a.device, a.dtype)
    if cfg.split_k > 1:
        raise ValueError("grouped_gemm does not split the reduction; use a TileConfig with split_k=1")
    # Each tile holds >= 1 row and each expert wastes < 1 tile, which bounds the tile count.
    max_tiles = min(t, triton.cdiv(t, cfg.block_m) + w.experts)
    tile_expert, tile_row = tile_map(expert_offsets, cfg.block_m, max_tiles)
    num_p = triton.cdiv(p, cfg.block_p)
    gs = w.global_scale if w.global_scale is not None else w.scale
    _grouped_kernel[(max_tiles * num_p,)](
        a, w.values, w.scale, gs, out, tile_expert, tile_row, expert_offsets,
        p, r, w.n, w.k, w.scale.shape[-1], w.experts,
        a.stride(0), a.stride(1), w.values.stride(0), w.values.stride(1),
        w.scale.stride(0), w.scale.stride(1), out.stride(0), out.stride(1),
        FMT=w.fmt.code, GROUP=w.group, DX=dx, SWAP=cfg.swap_ab, BM=cfg.block_m, BP=cfg.block_p,
        BR=cfg.block_r, PREC=dot_precision(a.dtype), K_EVEN=k_even(w, cfg, dx), FAST_INT4=fast_int4(w, a.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
