"""Fused LoRA for decode-sized batches: out = y + scale * (x @ A^T) @ B^T in two launches.

Unfused, a LoRA layer at decode costs five tiny launches (two GEMMs, one of them split-K with its
reduce, the scale, the add). Here the first launch computes the rank-r projection t = x A^T split over K
(one K slice per program, fp32 partials), and the second sums the partials in slice order (deterministic),
rounds t to the adapter dtype like the F.linear it replaces, applies its N tile of B and adds onto y.
(One launch that recomputed t in every N program was measured at 17 us per layer on the H200: a long
sequential K loop per program.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_BM, _BN, _BK = 16, 64, 256
MAX_ROWS = 64  # decode batches; larger ones keep torch's GEMMs


@triton.jit(do_not_specialize=["M"])
def _lora_down_kernel(x_ptr, a_ptr, ws_ptr, M, K, R, stride_xm, stride_am,
                      BM: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr):
    """Partial t_s = x[:, K-slice s] @ A[:, K-slice s]^T, fp32 [BM, BR], into ws[s] (one K slice per program)."""
    s = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    ranks = tl.arange(0, BR)
    ks = s * BK + tl.arange(0, BK)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K),
                other=0.0)
    a = tl.load(a_ptr + ranks[:, None] * stride_am + ks[None, :], mask=(ranks[:, None] < R) & (ks[None, :] < K),
                other=0.0)
    t = tl.dot(x.to(a.dtype), tl.trans(a))
    tl.store(ws_ptr + (s * M + rows[:, None]) * BR + ranks[None, :], t, mask=rows[:, None] < M)


@triton.jit(do_not_specialize=["M", "S"])
def _lora_up_kernel(ws_ptr, b_ptr, y_ptr, out_ptr, M, N, R, S, scale, stride_bn, stride_ym, stride_om,
                    BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr):
    """out = y + scale * round(sum_s ws[s]) @ B^T for one (row tile, N tile); partials summed in slice order."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    ranks = tl.arange(0, BR)
    cols = pid_n * BN + tl.arange(0, BN)
    t = tl.zeros((BM, BR), dtype=tl.float32)
    for s in range(0, S):
        t += tl.load(ws_ptr + (s * M + rows[:, None]) * BR + ranks[None, :], mask=rows[:, None] < M, other=0.0)
    b = tl.load(b_ptr + cols[:, None] * stride_bn + ranks[None, :], mask=(cols[:, None] < N) & (ranks[None, :] < R),
                other=0.0)
    delta = tl.dot(t.to(b.dtype), tl.trans(b))  # [BM, BN] fp32
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    y = tl.load(y_ptr + rows[:, None] * stride_ym + cols[None, :], mask=mask, other=0.0)
    # Same rounding steps as `y + (F.linear(F.linear(x, A), B) * scale).to(y.dtype)`.
    delta = (delta.to(b.dtype).to(tl.float32) * scale).to(y.dtype)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], y + delta, mask=mask)


def lora_add(y: Tensor, x: Tensor, a: Tensor, b: Tensor, scale: float) -> Tensor:
    """y [..., N] + scale * (x [..., K] @ a[r, K]^T) @ b[N, r]^T, for at most MAX_ROWS rows. Returns a new
    tensor shaped like y."""
    k, n, r = x.shape[-1], y.shape[-1], a.shape[0]
    if a.shape != (r, k) or b.shape != (n, r):
        raise ValueError(f"lora_add: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit x [..., {k}] -> y [..., {n}]")
    x2, y2 = x.reshape(-1, k), y.reshape(-1, n)
    m = x2.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"lora_add serves decode batches of <= {MAX_ROWS} rows, got {m}")
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if y2.stride(-1) != 1:
        y2 = y2.contiguous()
    a, b = a.contiguous(), b.contiguous()
    out = torch.empty_like(y2)
    if m:
        br = max(16, triton.next_power_of_2(r))
        slices, row_tiles = triton.cdiv(k, _BK), triton.cdiv(m, _BM)
        ws = torch.empty((slices, m, br), dtype=torch.float32, device=x.device)
        _lora_down_kernel[(slices, row_tiles)](x2, a, ws, m, k, r, x2.stride(0), a.stride(0), BM=_BM, BK=_BK, BR=br,
                                               num_warps=4)
        _lora_up_kernel[(triton.cdiv(n, _BN), row_tiles)](ws, b, y2, out, m, n, r, slices, scale, b.stride(0),
                                                          y2.stride(0), out.stride(0), BM=_BM, BN=_BN, BR=br,
                                                          num_warps=4)
    return out.view(y.shape)
