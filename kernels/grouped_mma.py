"""MoE decode: the grouped forward over active experts as gemv_mma.py's per-thread mma GEMV, one expert per program.

At decode an expert gets a handful of rows (batch 1 of a top-8 model: 8 experts x 1 row), so grouped.py's tile
kernel, 64 weight rows by 16 token rows per program, runs few programs (96 for Qwen3-30B-A3B's gate at batch 1) that
move 0.5-0.8 TB/s. Here a program takes one 8-row tile of one expert's rows (grouped._find_tile with 8-row tiles)
and 16 * MT of its weight rows, and runs gemv_mma.py's M <= 8 main loop on them: K split over the program's warps,
summed in a fixed order, so results are deterministic. Weights of experts without rows are never read; rows past
an expert's first 8 take another tile, which reads its weights again (mostly from L2): `configs.pick_grouped_mma`
keeps this kernel to batches of at most GROUPED_MMA_ROWS rows per expert on average, where it was measured ahead.
With the up projection too, a program takes 16 rows of gate and of up as its two row tiles and writes SwiGLU's
silu(gate) * up (kernels/activation.py's steps): one launch for the expert MLP's first half.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .activation import silu_times
from .configs import MMA_ROW_TILE, TILE_K, GemvConfig, max_row_tiles, sm_count
from .emulate import INTERPRETED
from .formats import PackedWeight
from .gemv_mma import (
    _TILE_K,
    _gather,
    _load_weights,
    activation_lanes,
    lane_addresses,
    load_w_asm,
    mma_mainloop,
    tile_asm,
    warps_for,
)
from .grouped import _find_tile
from .grouped_lora import ExpertLora, grouped_lora_a
from .pdl import launch_dependents, use_pdl, wait_for_producers

_ROW_TILE = tl.constexpr(MMA_ROW_TILE)  # (the mma's n8 columns: activation_lanes and _gather assume 8)
_LIBDEVICE = tl.constexpr(not INTERPRETED)  # SiLU's exp (the interpreter has no libdevice: numpy's there)


@triton.jit
def _grouped_mma_kernel(x_ptr, w_ptr, s_ptr, w2_ptr, s2_ptr, out_ptr, offsets_ptr, N, num_experts, stride_xm,
                        stride_om, stride_we, STRIDE_W: tl.constexpr, stride_se, STRIDE_S: tl.constexpr,
                        tiles_per_warp,
                        u_ptr, b_ptr, b2_ptr, stride_ut, stride_be, stride_bn, scale,
                        GROUP: tl.constexpr, MT: tl.constexpr, U: tl.constexpr, LOAD: tl.constexpr,
                        NW: tl.constexpr, E_POW2: tl.constexpr, PDL: tl.constexpr, SWIGLU: tl.constexpr,
                        LORA: tl.constexpr, R: tl.constexpr, R_POW2: tl.constexpr, PAIRS: tl.constexpr,
                        TILE: tl.constexpr, TILED: tl.constexpr):  # fmt: skip
    """out = x W^T per expert; SWIGLU: out = silu(x W^T) * (x W2^T) (W2 laid out as W: the up projection), each
    program then taking 16 rows of both. LORA: plus scale B_e (A_e x) per projection, from u = A_e x (grouped_lora.py:
    [T, projections, R]) and B [E, N, R] (b2_ptr: up's)."""
    BN: tl.constexpr = 16 if SWIGLU else 16 * MT
    num_n = N // BN
    t = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n
    wait_for_producers(PDL, False)  # the offsets (and rows) come from the kernels just before
    e, first, end = _find_tile(offsets_ptr, t, num_experts, _ROW_TILE, E_POW2)
    if e < num_experts:  # the grid's spare tiles do nothing
        lane = tl.arange(0, 32 * NW)
        g = (lane % 32) // 4
        k_lo = (lane // 32) * (tiles_per_warp * _TILE_K)  # (the host picks warps that divide K's tiles)
        e64 = e.to(tl.int64)
        w_lane, s_lane = lane_addresses(w_ptr + e64 * stride_we, s_ptr + e64 * stride_se, pid_n * BN + g, k_lo,
                                        STRIDE_W, STRIDE_S, GROUP, PAIRS, TILED)  # fmt: skip
        w_lane, s_lane = (w_lane,), (s_lane,)  # every row tile at a constant offset (gemv_mma._load_weights)
        if SWIGLU:  # the up rows are the loop's second row tile: a base of their own
            up_w, up_s = lane_addresses(w2_ptr + e64 * stride_we, s2_ptr + e64 * stride_se, pid_n * BN + g, k_lo,
                                        STRIDE_W, STRIDE_S, GROUP, PAIRS, TILED)  # fmt: skip
            w_lane, s_lane = w_lane + (up_w,), s_lane + (up_s,)
        x_lane = activation_lanes(x_ptr, first + g, end, k_lo, stride_xm, 1, PAIRS)
        nxt = _load_weights(w_lane, s_lane, STRIDE_W, STRIDE_S, GROUP, U, MT, LOAD, PAIRS, TILED)
        acc = mma_mainloop(nxt, w_lane, s_lane, x_lane, tiles_per_warp, k_lo, STRIDE_W, STRIDE_S, GROUP, MT, 1, U, LOAD,
                           NW, PAIRS, TILE, 1, TILED)  # fmt: skip
        launch_dependents(PDL)
        offs_m = first + tl.arange(0, _ROW_TILE)
        dt: tl.constexpr = out_ptr.dtype.element_ty
        lora = (u_ptr, stride_ut, stride_be, stride_bn, scale, e64, offs_m, end)
        if SWIGLU:
            gate, up = acc[0], acc[1]
            offs_n = pid_n * BN + tl.arange(0, 16)
            g_y = _projection_out(_gather(gate[0], gate[1], gate[2], gate[3], NW), b_ptr, 0, offs_n, lora, dt, LORA, R,
                                  R_POW2)  # fmt: skip
            u_y = _projection_out(_gather(up[0], up[1], up[2], up[3], NW), b2_ptr, 1, offs_n, lora, dt, LORA, R,
                                  R_POW2)  # fmt: skip
            ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
            tl.store(ptrs, silu_times(g_y, u_y, dt, _LIBDEVICE), mask=offs_m[None, :] < end)
        else:
            for m in tl.static_range(MT):
                c = acc[m]
                offs_n = pid_n * BN + 16 * m + tl.arange(0, 16)
                y = _projection_out(_gather(c[0], c[1], c[2], c[3], NW), b_ptr, 0, offs_n, lora, dt, LORA, R, R_POW2)
                ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
                tl.store(ptrs, y, mask=offs_m[None, :] < end)


@triton.jit
def _projection_out(y, b_ptr, j, offs_n, lora, dt: tl.constexpr, LORA: tl.constexpr, R: tl.constexpr,
                    R_POW2: tl.constexpr):  # fmt: skip
    """One [16 weight rows, 8 activation rows] tile of a projection in dt: y (fp32 sums) rounded, or with LORA
    LoraExperts.linear's steps: B_e[rows] . u[activation rows, j] summed in fp32 and rounded to dt, scaled and
    rounded, added to y rounded and rounded again, as torch's grouped GEMM, scale and add round (the delta's fp32
    sum runs in another order than torch's grouped GEMM's)."""
    if LORA:
        u_ptr, stride_ut, stride_be, stride_bn, scale, e64, offs_m, end = lora
        r = tl.arange(0, R_POW2)
        b = tl.load(b_ptr + e64 * stride_be + offs_n[:, None].to(tl.int64) * stride_bn + r[None, :],
                    mask=r[None, :] < R, other=0.0).to(tl.float32)  # fmt: skip
        u = tl.load(u_ptr + offs_m[:, None].to(tl.int64) * stride_ut + j * R + r[None, :],
                    mask=(offs_m[:, None] < end) & (r[None, :] < R), other=0.0).to(tl.float32)  # fmt: skip
        delta = tl.sum(b[:, None, :] * u[None, :, :], axis=2).to(dt).to(tl.float32)  # [16, 8]: B u, rounded
        delta = (delta * scale).to(dt).to(tl.float32)
        return (y.to(dt).to(tl.float32) + delta).to(dt)
    else:
        return y.to(dt)


def same_layout(w: PackedWeight, up: PackedWeight) -> bool:
    """Whether `up` can be read with `w`'s shape, groups and strides (the SwiGLU kernel's second weight)."""
    return ((up.fmt, up.experts, up.n, up.k, up.group) == (w.fmt, w.experts, w.n, w.k, w.group)
            and up.values.stride() == w.values.stride() and up.scale.stride() == w.scale.stride())  # fmt: skip


def grouped_mma(x: Tensor, expert_offsets: Tensor, w: PackedWeight, cfg: GemvConfig,
                up: PackedWeight | None = None, lora: ExpertLora | None = None) -> Tensor:
    """out[rows_e] = x[rows_e] @ W_e^T for the stacked int4 experts `w` (configs.mma_ok), x bf16 [T, K] sorted by
    expert with rows on 16-byte boundaries, expert_offsets int [E + 1] on x's device (grouped_gemm's contract).
    With `up` (the up projection, laid out as `w`): silu(x W_e^T) * (x Up_e^T), bitwise what the two projections
    at `cfg` and kernels.silu_mul give (SwiGLU in one launch; cfg.block_n must be 16). With `lora` (its A and B per
    projection, gate then up): each projection plus lora.scale * B_e (A_e x), in a second launch before (u = A_e x,
    grouped_lora.py). Returns [T, N] bf16."""
    t, k = x.shape
    out = torch.empty((t, w.n), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    swiglu = up is not None
    if swiglu and (cfg.block_n != 16 or not same_layout(w, up)):
        raise ValueError("grouped_mma's SwiGLU takes block_n 16 and gate and up weights of one shape and layout")
    r, u = 1, out
    if lora is not None:
        r, b0 = lora.a[0].shape[1], lora.b[0]
        if len(lora.a) != len(lora.b) or len(lora.b) != (2 if swiglu else 1) or lora.a[0].shape[0] != w.experts or any(
                b.shape != (w.experts, w.n, r) or b.stride() != b0.stride() or b.stride(2) != 1 or b.dtype != x.dtype
                for b in lora.b):  # fmt: skip
            raise ValueError(f"grouped_mma's LoRA takes an A [E, r, K] and a B [E, N={w.n}, r] per projection in "
                             f"{x.dtype}, got B {[tuple(b.shape) for b in lora.b]}")
        u = grouped_lora_a(x, expert_offsets, lora.a)  # (checks the A's)
    programs = max_row_tiles(t, MMA_ROW_TILE, w.experts) * (w.n // cfg.block_n)
    nw = warps_for(cfg, programs, k, sm_count(x.device))
    pdl = use_pdl(x.device)
    up = up or w
    bs, scale = (lora.b, lora.scale) if lora is not None else ((out,), 0.0)
    _grouped_mma_kernel[(programs,)](
        x, w.values, w.scale, up.values, up.scale, out, expert_offsets, w.n, w.experts, x.stride(0), out.stride(0),
        w.values.stride(0), w.values.stride(1), w.scale.stride(0), w.scale.stride(1), k // TILE_K // nw,
        u, bs[0], bs[-1], u.stride(0), bs[0].stride(0), bs[0].stride(-2), scale,
        **kernel_constexprs(cfg, w.group, nw, w.experts, swiglu, r if lora is not None else 0, pdl, w.tiled),
        launch_pdl=pdl, num_warps=nw, enable_fp_fusion=False, enable_reflect_ftz=False,
    )  # fmt: skip
    return out


def kernel_constexprs(cfg: GemvConfig, group: int, nw: int, experts: int, swiglu: bool, rank: int,
                      pdl: bool, tiled: bool = False) -> dict:  # fmt: skip
    """_grouped_mma_kernel's compile-time arguments for `cfg` at scale groups `group`, nw warps a program, `experts`
    experts, SwiGLU or not, LoRA rank `rank` (0: none) and weights in int4-tiled's layout or not, less the weights' row
    strides (STRIDE_W, STRIDE_S, which the launch passes with the other strides): the one list the launch and the sm_90
    compile test share."""
    r = max(rank, 1)
    return dict(GROUP=group, MT=2 if swiglu else cfg.block_n // 16, U=cfg.mma_tiles, NW=nw, PAIRS=cfg.mma_word_pairs,
                LOAD=load_w_asm(cfg.l2_prefetch, cfg.mma_word_pairs, group),
                TILE=tile_asm(1, cfg.mma_word_pairs, tiled), E_POW2=triton.next_power_of_2(experts), PDL=pdl,
                SWIGLU=swiglu, LORA=rank > 0, R=r,
                R_POW2=triton.next_power_of_2(r),
                TILED=tiled)  # fmt: skip
