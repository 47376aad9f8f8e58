"""Fused LoRA for decode-sized batches: out = y + scale * (x @ A^T) @ B^T in two launches.

Unfused, a LoRA layer at decode costs five tiny launches (two GEMMs, one of them split-K with its
reduce, the scale, the add). Here the first launch computes the rank-r projection t = x A^T split over K
(one K slice per program, fp32 partials), and the second sums the partials in slice order (deterministic),
rounds t to the adapter dtype like the F.linear it replaces, applies its N tile of B and adds onto y.
(One launch that recomputed t in every N program was measured at 17 us per layer on the H200: a long
sequential K loop per program.)

`lora_add_many` serves layers that read one input and write one output side by side (q/k/v, gate/up after
quant.fusion): up to three adapters, still two launches, a program axis picking each one's tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .formats import as_rows
from .pdl import use_pdl, wait_for_producers

_BM, _BN, _BK = 16, 64, 256
MAX_ROWS = 64  # decode batches; larger ones keep torch's GEMMs


MAX_SEGMENTS = 3


@triton.jit
def _pick(seg, v0, v1, v2):
    """v0, v1 or v2 by a segment index (pointers or scalars)."""
    if seg == 0:
        v = v0
    elif seg == 1:
        v = v1
    else:
        v = v2
    return v


@triton.jit(do_not_specialize=["M"])
def _lora_down_kernel(x_ptr, a0, a1, a2, ws_ptr, M, K, R, stride_xm, BM: tl.constexpr, BK: tl.constexpr,
                      BR: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """Partial t_s = x[:, K-slice s] @ A_g[:, K-slice s]^T, fp32 [BM, BR], into ws[g, s] (one K slice and one
    adapter g per program; every A is [R, K] contiguous)."""
    wait_for_producers(PDL)
    s = tl.program_id(0)
    pid_m = tl.program_id(1)
    seg = tl.program_id(2)
    a_ptr = _pick(seg, a0, a1, a2)
    rows = pid_m * BM + tl.arange(0, BM)
    ranks = tl.arange(0, BR)
    ks = s * BK + tl.arange(0, BK)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K),
                other=0.0)
    a = tl.load(a_ptr + ranks[:, None] * K + ks[None, :], mask=(ranks[:, None] < R) & (ks[None, :] < K), other=0.0)
    t = tl.dot(x.to(a.dtype), tl.trans(a))
    slot = seg * tl.num_programs(0) + s
    tl.store(ws_ptr + (slot * M + rows[:, None]) * BR + ranks[None, :], t, mask=rows[:, None] < M)


@triton.jit(do_not_specialize=["M", "S", "n0", "n1", "n2"])  # (an int 1 would become a constexpr in _pick)
def _lora_up_kernel(ws_ptr, b0, b1, b2, y_ptr, out_ptr, M, R, S, n0, n1, n2, scale0, scale1, scale2,
                    stride_ym, stride_om, BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr,
                    PDL: tl.constexpr):  # fmt: skip
    """out[:, cols of g] = y + scale_g * round(sum_s ws[g, s]) @ B_g^T for one (row tile, N tile); adapter g's
    columns follow those of the adapters before it, and its tiles those of theirs. Partials in slice order."""
    wait_for_producers(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    t1 = tl.cdiv(n0, BN)
    t2 = t1 + tl.cdiv(n1, BN)
    seg = (pid_n >= t1).to(tl.int32) + (pid_n >= t2).to(tl.int32)
    b_ptr = _pick(seg, b0, b1, b2)
    n = _pick(seg, n0, n1, n2)
    scale = _pick(seg, scale0, scale1, scale2)
    tile0 = _pick(seg, t1 * 0, t1, t2)  # (t1 * 0: one type in every branch)
    col0 = _pick(seg, n0 * 0, n0, n0 + n1)
    rows = pid_m * BM + tl.arange(0, BM)
    ranks = tl.arange(0, BR)
    cols = (pid_n - tile0) * BN + tl.arange(0, BN)  # within adapter g's output
    t = tl.zeros((BM, BR), dtype=tl.float32)
    for s in range(0, S):
        t += tl.load(ws_ptr + ((seg * S + s) * M + rows[:, None]) * BR + ranks[None, :], mask=rows[:, None] < M,
                     other=0.0)
    b = tl.load(b_ptr + cols[:, None] * R + ranks[None, :], mask=(cols[:, None] < n) & (ranks[None, :] < R), other=0.0)
    delta = tl.dot(t.to(b.dtype), tl.trans(b))  # [BM, BN] fp32
    mask = (rows[:, None] < M) & (cols[None, :] < n)
    y = tl.load(y_ptr + rows[:, None] * stride_ym + col0 + cols[None, :], mask=mask, other=0.0)
    # Same rounding steps as `y + (F.linear(F.linear(x, A), B) * scale).to(y.dtype)`.
    delta = (delta.to(b.dtype).to(tl.float32) * scale).to(y.dtype)
    tl.store(out_ptr + rows[:, None] * stride_om + col0 + cols[None, :], y + delta, mask=mask)


def lora_add(y: Tensor, x: Tensor, a: Tensor, b: Tensor, scale: float) -> Tensor:
    """y [..., N] + scale * (x [..., K] @ a[r, K]^T) @ b[N, r]^T, for at most MAX_ROWS rows. Returns a new
    tensor shaped like y."""
    return lora_add_many(y, x, [a], [b], [scale])


def lora_add_many(y: Tensor, x: Tensor, a: list[Tensor], b: list[Tensor], scale: list[float]) -> Tensor:
    """lora_add for up to MAX_SEGMENTS adapters of one rank reading x and writing side by side: y [..., sum N_g],
    adapter g (A_g [r, K], B_g [N_g, r], scale_g) adding onto the columns after those of adapters < g. Returns
    a new tensor shaped like y."""
    if not 1 <= len(a) <= MAX_SEGMENTS or len(a) != len(b) or len(a) != len(scale):
        raise ValueError(f"lora_add_many takes 1 to {MAX_SEGMENTS} (A, B, scale) triples, got {len(a)}, {len(b)}, "
                         f"{len(scale)}")  # fmt: skip
    k, r = x.shape[-1], a[0].shape[0]
    ns = [bg.shape[0] for bg in b]
    n = y.shape[-1]
    for ag, bg in zip(a, b):
        if ag.shape != (r, k) or bg.dim() != 2 or bg.shape[1] != r:
            raise ValueError(f"lora_add: A {tuple(ag.shape)} / B {tuple(bg.shape)} do not fit x [..., {k}] and "
                             f"rank {r}")  # fmt: skip
    if sum(ns) != n:
        raise ValueError(f"lora_add: B outputs {ns} do not add up to y [..., {n}]")
    x2, y2 = as_rows(x, k), as_rows(y, n)
    m = x2.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"lora_add serves decode batches of <= {MAX_ROWS} rows, got {m}")
    a = [t.contiguous() for t in a]
    b = [t.contiguous() for t in b]
    pad = MAX_SEGMENTS - len(a)
    out = torch.empty((m, n), dtype=y.dtype, device=y.device)
    if m:
        br = max(16, triton.next_power_of_2(r))
        pdl = use_pdl(x.device)
        slices, row_tiles = triton.cdiv(k, _BK), triton.cdiv(m, _BM)
        ws = torch.empty((len(a), slices, m, br), dtype=torch.float32, device=x.device)
        _lora_down_kernel[(slices, row_tiles, len(a))](x2, *a, *a[:1] * pad, ws, m, k, r, x2.stride(0), BM=_BM,
                                                       BK=_BK, BR=br, PDL=pdl, launch_pdl=pdl, num_warps=4)  # fmt: skip
        n_tiles = sum(triton.cdiv(ng, _BN) for ng in ns)
        _lora_up_kernel[(n_tiles, row_tiles)](ws, *b, *b[:1] * pad, y2, out, m, r, slices, *ns, *[0] * pad,
                                              *map(float, scale), *[0.0] * pad, y2.stride(0), out.stride(0),
                                              BM=_BM, BN=_BN, BR=br, PDL=pdl, launch_pdl=pdl, num_warps=4)  # fmt: skip
    return out.view(y.shape)
