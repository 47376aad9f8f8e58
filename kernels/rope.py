"""Rotary embedding of q and k in one launch, bitwise equal to `models.layers.apply_rope`'s torch ops (optionally
after Qwen3's per-head q/k RMSNorm, in the same launch).

`apply_rope` casts cos/sin to x.dtype, then evaluates `x * cos`, `rotate(x) * sin` and their sum, each op
computing in fp32 and rounding to x.dtype. The kernel repeats exactly those steps (the rotation's negation
and the cast to fp32 are exact), with mul+add contraction off so no product skips its rounding. Both layouts
reduce to one formula per output lane j, with half = d // 2 and c, s = cos[jc], sin[jc]:
    out[j] = rnd(rnd(x[ia] * c) + rnd(±x[ib] * s)),  minus for j < half
    rotate-half: jc = j,          ia = j,                ib = j ± half
    interleave:  jc = j % half,   ia = 2 jc + (j >= half), ib = 2 jc + (j < half)
LLVM may turn a rounded fp32 product or sum of two bf16/fp16 values into a native bf16/fp16 op: the same
correctly rounded result, as fp32 holds at least 2p+2 bits of a p-bit format. In Triton's interpreter bf16
casts truncate, so there the kernel matches torch in fp32 and fp16 only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .pdl import use_pdl, wait_for_producers

_TILE = 2048  # elements per program: heads x head_dim


@triton.jit
def _rnd(v, dtype: tl.constexpr):
    """Round fp32 to `dtype` and back: the rounding a torch op storing `dtype` applies."""
    return v.to(dtype).to(tl.float32)


@triton.jit
def _rope_heads(x_ptr, o_ptr, w_ptr, eps, heads, hb, bi, ti, sxb, sxh, sxt, sxd, sob, soh, sot, c, s, j, ia, ib, first,
                lane_ok, D: tl.constexpr, BLOCK_H: tl.constexpr, NORM: tl.constexpr):  # fmt: skip
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (h < heads)[:, None] & lane_ok[None, :]
    x_row = x_ptr + bi * sxb + ti * sxt + h[:, None].to(tl.int64) * sxh
    xa = tl.load(x_row + ia[None, :] * sxd, mask=mask, other=0.0).to(tl.float32)
    xb = tl.load(x_row + ib[None, :] * sxd, mask=mask, other=0.0).to(tl.float32)
    dt: tl.constexpr = o_ptr.dtype.element_ty
    if NORM:  # each head row's RMSNorm first, with rmsnorm.py's steps (ia visits every lane of the row once)
        rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(xa * xa, axis=1) / D + eps))[:, None]
        wa = tl.load(w_ptr + ia, mask=lane_ok, other=0.0).to(tl.float32)[None, :]
        wb = tl.load(w_ptr + ib, mask=lane_ok, other=0.0).to(tl.float32)[None, :]
        xa = _rnd(_rnd(xa * rstd, dt) * wa, dt)
        xb = _rnd(_rnd(xb * rstd, dt) * wb, dt)
    xb = tl.where(first[None, :], -xb, xb)
    out = _rnd(xa * c[None, :], dt) + _rnd(xb * s[None, :], dt)
    o_row = o_ptr + bi * sob + ti * sot + h[:, None].to(tl.int64) * soh
    tl.store(o_row + j[None, :], out.to(dt), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, eps, T, HQ, HK, q_blocks,
                 sqb, sqh, sqt, sqd, skb, skh, skt, skd, sqob, sqoh, sqot, skob, skoh, skot,
                 scb, sct, scd, ssb, sst, ssd,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, INTERLEAVE: tl.constexpr,
                 NORM: tl.constexpr, PDL: tl.constexpr):
    wait_for_producers(PDL)
    row = tl.program_id(0)  # one (batch, position)
    hb = tl.program_id(1)  # a block of q heads, then of k heads
    bi = (row // T).to(tl.int64)
    ti = (row % T).to(tl.int64)
    HALF: tl.constexpr = D // 2
    j = tl.arange(0, BLOCK_D)
    lane_ok = j < D
    first = j < HALF
    if INTERLEAVE:
        jc = j % HALF
        ia = 2 * jc + tl.where(first, 0, 1)
        ib = 2 * jc + tl.where(first, 1, 0)
    else:
        jc = j
        ia = j
        ib = tl.where(first, j + HALF, j - HALF)
    dt: tl.constexpr = qo_ptr.dtype.element_ty
    # apply_rope's `cos.to(x.dtype)`: one rounding of the fp32 table.
    c = _rnd(tl.load(cos_ptr + bi * scb + ti * sct + jc * scd, mask=lane_ok, other=0.0).to(tl.float32), dt)
    s = _rnd(tl.load(sin_ptr + bi * ssb + ti * sst + jc * ssd, mask=lane_ok, other=0.0).to(tl.float32), dt)
    if hb < q_blocks:
        _rope_heads(q_ptr, qo_ptr, qw_ptr, eps, HQ, hb, bi, ti, sqb, sqh, sqt, sqd, sqob, sqoh, sqot, c, s, j, ia, ib,
                    first, lane_ok, D, BLOCK_H, NORM)  # fmt: skip
    else:
        _rope_heads(k_ptr, ko_ptr, kw_ptr, eps, HK, hb - q_blocks, bi, ti, skb, skh, skt, skd, skob, skoh, skot, c,
                    s, j, ia, ib, first, lane_ok, D, BLOCK_H, NORM)  # fmt: skip


def _out_like(x: Tensor, interleave: bool) -> Tensor:
    """A dense output laid out as torch's apply_rope returns it: the interleaved form ends in a `cat`
    (contiguous); the rotate-half form is elementwise, so it keeps x's dimension order."""
    if interleave:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    order = sorted(range(x.dim()), key=lambda i: -x.stride(i))  # outermost first, stable on ties
    return torch.empty([x.shape[i] for i in order], dtype=x.dtype, device=x.device).permute(
        [order.index(i) for i in range(x.dim())])


def rope(q: Tensor, k: Tensor | None, cos: Tensor, sin: Tensor, interleave: bool = False,
         norm_weights: tuple[Tensor, Tensor] | None = None, eps: float = 1e-6) -> tuple[Tensor, Tensor | None]:
    """Rotary embedding of q [B, H, T, d] and k [B, Hkv, T, d] (any strides) with cos/sin [B, T, d] (fp32, as
    `Rotary` makes them; a batch of 1 broadcasts). Returns (q_out, k_out) in q's dtype, bitwise equal to
    `apply_rope(q, cos, sin, interleave), apply_rope(k, cos, sin, interleave)`. k may be None (q alone).

    norm_weights (q's and k's RMSNorm weights [d], q's dtype; Qwen3's q/k norms): each head row is normalized first
    with `rms_norm`'s rounding steps, in the same launch. Its sum of squares is reduced in this kernel's order, so
    the result can differ from `rms_norm` then `rope` in the last bit (not for batch-invariant mode)."""
    k_out = k is not None
    if norm_weights is not None:
        if any(w.shape != (q.shape[-1],) or w.dtype != q.dtype or w.device != q.device for w in norm_weights):
            raise ValueError(f"rope's norm_weights must be two [{q.shape[-1]}] tensors of q's dtype and device")
        if k is None:
            raise ValueError("rope with norm_weights needs k")
    k = q[:, :0] if k is None else k  # no k heads: no k programs
    if q.dim() != 4 or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"rope expects q [B, H, T, d] and k [B, Hkv, T, d], got {tuple(q.shape)}, {tuple(k.shape)}")
    if q.dtype != k.dtype or q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"rope needs q and k of one dtype among bf16/fp16/fp32, got {q.dtype} and {k.dtype}")
    b, hq, t, d = q.shape
    if d % 2:
        raise ValueError(f"rope needs an even head dim, got {d}")
    if len({q.device, k.device, cos.device, sin.device}) != 1:
        raise ValueError("rope inputs must share one device")
    cos, sin = cos.expand(b, t, d), sin.expand(b, t, d)
    qo, ko = _out_like(q, interleave), _out_like(k, interleave)
    hk = k.shape[1]
    block_d = triton.next_power_of_2(d)
    block_h = max(1, min(triton.next_power_of_2(max(hq, hk)), _TILE // block_d))
    q_blocks = triton.cdiv(hq, block_h)
    grid = (b * t, q_blocks + triton.cdiv(hk, block_h))
    pdl = use_pdl(q.device)
    if b * t and hq + hk:
        qw, kw = norm_weights if norm_weights is not None else (cos, cos)
        _rope_kernel[grid](
            q, k, qo, ko, cos, sin, qw, kw, eps, t, hq, hk, q_blocks,
            q.stride(0), q.stride(1), q.stride(2), q.stride(3), k.stride(0), k.stride(1), k.stride(2), k.stride(3),
            qo.stride(0), qo.stride(1), qo.stride(2), ko.stride(0), ko.stride(1), ko.stride(2),
            *cos.stride(), *sin.stride(),
            D=d, BLOCK_D=block_d, BLOCK_H=block_h, INTERLEAVE=interleave, NORM=norm_weights is not None, PDL=pdl,
            launch_pdl=pdl,
            num_warps=max(1, min(4, block_h * block_d // 256)),
            enable_fp_fusion=False,  # x*cos + rot*sin must round the products, as torch's separate ops do
        )
    return qo, ko if k_out else None
