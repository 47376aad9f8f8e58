"""Batch-invariant RMSNorm: one program per row, fixed-size chunks, so a row's result never depends
on how many rows share the launch (torch's fused reductions may change strategy with the batch)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .formats import as_rows
from .pdl import use_pdl, wait_for_producers

# The chunk depends on the hidden size only, so the reduction order does too. Up to 8192 a row is one chunk:
# at decode a launch is a handful of rows, and each chunk of a longer loop costs a dependent memory round trip.
_BLOCK = 8192


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, out_ptr, h_ptr, sum_ptr, H, stride_x, stride_o, stride_h, stride_s, eps,
                    BLOCK: tl.constexpr, RESIDUAL: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """out = RMSNorm(v) * w per row, v = x, or (RESIDUAL) v = x + h rounded to x's dtype and also stored to sum:
    torch's `x + h`, so the pair is bitwise the add followed by this kernel on its result."""
    wait_for_producers(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    h_row = h_ptr + row * stride_h
    dt: tl.constexpr = x_ptr.dtype.element_ty
    sq = tl.zeros((BLOCK,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK):
        cols = h0 + tl.arange(0, BLOCK)
        v = tl.load(x_row + cols, mask=cols < H, other=0.0).to(tl.float32)
        if RESIDUAL:
            v = (v + tl.load(h_row + cols, mask=cols < H, other=0.0).to(tl.float32)).to(dt)
            tl.store(sum_ptr + row * stride_s + cols, v, mask=cols < H)
            v = v.to(tl.float32)
        sq += v * v
    # Correctly rounded sqrt/div (not the approximate rsqrt) to track torch.rsqrt closely.
    rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(sq, axis=0) / H + eps))
    for h0 in range(0, H, BLOCK):
        cols = h0 + tl.arange(0, BLOCK)
        mask = cols < H
        v = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if RESIDUAL:  # recomputed, not re-read: the same rounded sum
            v = (v + tl.load(h_row + cols, mask=mask, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        # Like HF's Qwen3/DeepSeek RMSNorm: normalize in fp32, round to the input dtype, then scale.
        normed = (v * rstd).to(dt).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """weight * normalize(x) over the last dim. x: [..., H]; weight: [H]; returns x's shape in the
    promoted dtype of x and weight (as `weight * normed.to(x.dtype)` would give)."""
    return _launch(x, None, weight, eps)[1]


def add_rms_norm(x: Tensor, h: Tensor, weight: Tensor, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """(x + h, rms_norm(x + h)) in one launch: a residual add and the next norm. x, h: [..., H] of one dtype."""
    if h.shape != x.shape or h.dtype != x.dtype or h.device != x.device:
        raise ValueError(f"add_rms_norm needs x and h of one shape, dtype and device, got {tuple(x.shape)} {x.dtype} "
                         f"and {tuple(h.shape)} {h.dtype}")  # fmt: skip
    return _launch(x, h, weight, eps)


def _launch(x: Tensor, h: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor | None, Tensor]:
    if x.shape[-1] != weight.shape[-1] or weight.dim() != 1:
        raise ValueError(f"rms_norm weight must be [H], H = {x.shape[-1]}, got {tuple(weight.shape)}")
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device} but weight is on {weight.device}")
    hid = x.shape[-1]
    x2 = as_rows(x, hid)
    out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    h2 = total = None
    if h is not None:
        h2, total = as_rows(h, hid), torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = min(_BLOCK, triton.next_power_of_2(hid))
        pdl = use_pdl(x.device)
        _rmsnorm_kernel[(x2.shape[0],)](
            x2, weight.contiguous(), out, x2 if h2 is None else h2, out if total is None else total, hid,
            x2.stride(0), out.stride(0), 0 if h2 is None else h2.stride(0), 0 if total is None else total.stride(0),
            eps, BLOCK=block, RESIDUAL=h2 is not None, PDL=pdl, launch_pdl=pdl, num_warps=8 if block >= 4096 else 4,
        )  # fmt: skip
    return (None if total is None else total.reshape(x.shape)), out.reshape(x.shape)

