"""Batch-invariant RMSNorm: one program per row, fixed-size chunks, so a row's result never depends
on how many rows share the launch (torch's fused reductions may change strategy with the batch)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

# The chunk depends on the hidden size only, so the reduction order does too. Up to 8192 a row is one chunk:
# at decode a launch is a handful of rows, and each chunk of a longer loop costs a dependent memory round trip.
_BLOCK = 8192


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, out_ptr, H, stride_x, stride_o, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    sq = tl.zeros((BLOCK,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK):
        cols = h0 + tl.arange(0, BLOCK)
        v = tl.load(x_row + cols, mask=cols < H, other=0.0).to(tl.float32)
        sq += v * v
    # Correctly rounded sqrt/div (not the approximate rsqrt) to track torch.rsqrt closely.
    rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(sq, axis=0) / H + eps))
    for h0 in range(0, H, BLOCK):
        cols = h0 + tl.arange(0, BLOCK)
        mask = cols < H
        v = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        # Like HF's Qwen3/DeepSeek RMSNorm: normalize in fp32, round to the input dtype, then scale.
        normed = (v * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """weight * normalize(x) over the last dim. x: [..., H]; weight: [H]; returns x's shape in the
    promoted dtype of x and weight (as `weight * normed.to(x.dtype)` would give)."""
    if x.shape[-1] != weight.shape[-1] or weight.dim() != 1:
        raise ValueError(f"rms_norm weight must be [H], H = {x.shape[-1]}, got {tuple(weight.shape)}")
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device} but weight is on {weight.device}")
    h = x.shape[-1]
    x2 = x.reshape(-1, h)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if x2.shape[0]:
        block = min(_BLOCK, triton.next_power_of_2(h))
        _rmsnorm_kernel[(x2.shape[0],)](x2, weight.contiguous(), out, h, x2.stride(0), out.stride(0), eps,
                                        BLOCK=block, num_warps=8 if block >= 4096 else 4)
    return out.reshape(x.shape)
