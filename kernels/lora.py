"""Fused LoRA for decode-sized batches: out = y + scale * (x @ A^T) @ B^T in two launches, or in one beside
the base's decode GEMV, whose epilogue takes the second half.

Unfused, a LoRA layer at decode costs five tiny launches (two GEMMs, one of them split-K with its
reduce, the scale, the add). Here `lora_down` computes the rank-r projection t = x A^T split over K (one
K slice per program, fp32 partials: a `LoraTerm`), and `lora_up` sums the partials in slice order
(deterministic), rounds t to the adapter dtype like the F.linear it replaces, applies its N tile of B and
adds onto y. The decode GEMV (gemv.py) can instead add the term where its output tile is final, with the
same `lora_delta`, so y is written once and a LoRA linear costs two launches, not three.
(One launch that recomputed t in every N program was measured at 17 us per layer on the H200: a long
sequential K loop per program.)

Rounding, the steps of `y + (F.linear(F.linear(x.to(A.dtype), A), B) * scale).to(y.dtype)`:
  t = fp32 sum of the slice partials, in slice order, rounded to the adapter dtype;
  d = t B^T accumulated in fp32, rounded to the adapter dtype;
  d = fp32 (d * scale), rounded to y's dtype;
  out = y + d, rounded once in y's dtype (y already rounded to its dtype: the base's output).
torch rounds `d * scale` to the adapter dtype before `.to(y.dtype)`; the two agree unless y is wider than
the adapter dtype (the layers hold both in one dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

_BM, _BN, _BK = 16, 64, 256
MAX_ROWS = 64  # decode batches; larger ones keep torch's GEMMs


@dataclass(frozen=True)
class LoraTerm:
    """The term scale * round(x A^T) @ B^T of one LoRA, half computed by `lora_down`: fp32 K-slice partials
    ws [S, M, BR] of t = x A^T (BR: r padded to a power of two >= 16, tl.dot's minimum; ranks >= r are 0)
    and the B [N, r] (unit stride along r) and scale of the up-projection that `lora_up` or the decode GEMV's
    epilogue applies."""

    ws: Tensor
    b: Tensor
    scale: float

    @property
    def rank(self) -> int:
        return self.b.shape[1]

    def check(self, m: int, n: int) -> None:
        """Raise unless the term adds onto an output of m rows and n columns."""
        if self.ws.shape[1] != m or self.b.shape[0] != n:
            raise ValueError(f"LoRA term of {self.ws.shape[1]} rows, B {tuple(self.b.shape)} does not fit an "
                             f"output [{m}, {n}]")  # fmt: skip

    def add_to(self, y: Tensor) -> Tensor:
        return lora_up(y, self)


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


@triton.jit
def lora_delta(ws_ptr, b_ptr, offs_n, offs_m, M, N, R, S, scale, stride_bn,
               BN: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr, OUT: tl.constexpr):
    """The LoRA term's [BN, BM] tile (transposed, like the GEMV's accumulator: columns offs_n, rows offs_m)
    in dtype OUT, rounded as the module docstring lists; 0 outside rows < M and columns < N. lora_up and the
    GEMV's epilogue both call it, so they add the same term by the same steps."""
    ranks = tl.arange(0, BR)
    t = tl.zeros((BM, BR), dtype=tl.float32)
    t_ptrs = ws_ptr + offs_m[:, None] * BR + ranks[None, :]
    for _ in range(0, S):  # slice order: the sum does not depend on which program wrote which slice first
        t += tl.load(t_ptrs, mask=(offs_m < M)[:, None], other=0.0)
        t_ptrs += M * BR
    b = tl.load(b_ptr + offs_n[:, None] * stride_bn + ranks[None, :],
                mask=(offs_n[:, None] < N) & (ranks[None, :] < R), other=0.0)  # fmt: skip
    t = t.to(b.dtype)
    if BM >= 16 and BN >= 16:
        d = tl.dot(b, tl.trans(t))
    else:  # below tl.dot's minimum tile (the GEMV's FMA configs): the same products, summed in registers
        d = tl.sum(b.to(tl.float32)[:, None, :] * t.to(tl.float32)[None, :, :], axis=2)
    return (d.to(b.dtype).to(tl.float32) * scale).to(OUT)


@triton.jit(do_not_specialize=["M", "S"])
def _lora_up_kernel(ws_ptr, b_ptr, y_ptr, out_ptr, M, N, R, S, scale, stride_bn, stride_ym, stride_om,
                    BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr):
    """out = y + the LoRA term for one (N tile, row tile), handled transposed like the GEMV's output tiles."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = pid_m * BM + tl.arange(0, BM)
    mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
    y = tl.load(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], mask=mask, other=0.0)
    y += lora_delta(ws_ptr, b_ptr, offs_n, offs_m, M, N, R, S, scale, stride_bn, BN, BM, BR, y.dtype)
    tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], y, mask=mask)


def lora_down(x: Tensor, a: Tensor, b: Tensor, scale: float) -> LoraTerm:
    """First launch of a decode LoRA: the partials of t = x [..., K] @ a[r, K]^T, for at most MAX_ROWS rows,
    with b [N, r] and scale for the up-projection."""
    k, r = x.shape[-1], a.shape[0]
    if a.shape != (r, k) or b.dim() != 2 or b.shape[1] != r:
        raise ValueError(f"LoRA A {tuple(a.shape)} / B {tuple(b.shape)} do not fit x [..., {k}]")
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"the fused LoRA serves decode batches of <= {MAX_ROWS} rows, got {m}")
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    a = a.contiguous()
    br = max(16, triton.next_power_of_2(r))
    slices, row_tiles = triton.cdiv(k, _BK), triton.cdiv(m, _BM)
    ws = torch.empty((slices, m, br), dtype=torch.float32, device=x.device)
    if m:
        _lora_down_kernel[(slices, row_tiles)](x2, a, ws, m, k, r, x2.stride(0), a.stride(0), BM=_BM, BK=_BK, BR=br,
                                               num_warps=4)
    return LoraTerm(ws, b.contiguous(), scale)


def lora_up(y: Tensor, term: LoraTerm) -> Tensor:
    """y [..., N] + the term, as a new tensor shaped like y (the second launch where no base kernel took the
    term into its epilogue)."""
    n = y.shape[-1]
    y2 = y.reshape(-1, n)
    m = y2.shape[0]
    term.check(m, n)
    if y2.stride(-1) != 1:
        y2 = y2.contiguous()
    out = torch.empty_like(y2)
    if m:
        slices, br = term.ws.shape[0], term.ws.shape[2]
        _lora_up_kernel[(triton.cdiv(n, _BN), triton.cdiv(m, _BM))](
            term.ws, term.b, y2, out, m, n, term.rank, slices, term.scale, term.b.stride(0), y2.stride(0),
            out.stride(0), BM=_BM, BN=_BN, BR=br, num_warps=4)  # fmt: skip
    return out.view(y.shape)


def lora_add(y: Tensor, x: Tensor, a: Tensor, b: Tensor, scale: float) -> Tensor:
    """y [..., N] + scale * (x [..., K] @ a[r, K]^T) @ b[N, r]^T, for at most MAX_ROWS rows. Returns a new
    tensor shaped like y."""
    n = y.shape[-1]
    if b.shape != (n, a.shape[0]):
        raise ValueError(f"LoRA A {tuple(a.shape)} / B {tuple(b.shape)} do not fit y [..., {n}]")
    return lora_up(y, lora_down(x, a, b, scale))
