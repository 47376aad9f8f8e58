"""Expert LoRA at decode: u = A_e x for every row routed to expert e, for one to two projections that read the same
rows (gate and up), in one launch. grouped_mma.py adds scale * B_e u in its epilogue (`ExpertLora`).

torch runs an expert LoRA as two grouped GEMMs, a scale and an add per projection: ~5 launches each, 15 per MoE layer
at decode, where the layer's base takes two. Here: one launch per input (gate and up share theirs) and none for B.
Rows are tiled 16 per program within an expert (grouped._find_tile); u is rounded to the adapters' dtype, as torch's
grouped GEMM output is.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from .configs import max_row_tiles
from .emulate import INTERPRETED
from .gemm import dot_precision
from .grouped import _find_tile
from .pdl import use_pdl, wait_for_producers

_BM = 16  # rows per program (tl.dot's minimum)
_BK = 128


@triton.jit
def _lora_a_kernel(x_ptr, a0_ptr, a1_ptr, u_ptr, offsets_ptr, num_experts, K, stride_xm, stride_ae, stride_ar,
                   J: tl.constexpr, R: tl.constexpr, R_POW2: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                   E_POW2: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    wait_for_producers(PDL)
    e, first, end = _find_tile(offsets_ptr, tl.program_id(0), num_experts, BM, E_POW2)
    j = tl.program_id(1)
    if e < num_experts:
        a_ptr = a0_ptr
        if J == 2 and j == 1:
            a_ptr = a1_ptr
        rows = first.to(tl.int64) + tl.arange(0, BM)
        r = tl.arange(0, R_POW2)
        kk = tl.arange(0, BK)
        acc = tl.zeros((BM, R_POW2), tl.float32)
        a_rows = a_ptr + e.to(tl.int64) * stride_ae + r[:, None] * stride_ar
        for k0 in range(0, K, BK):
            k = k0 + kk
            x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=(rows < end)[:, None] & (k < K)[None, :],
                        other=0.0)  # fmt: skip
            a = tl.load(a_rows + k[None, :], mask=(r < R)[:, None] & (k < K)[None, :], other=0.0)
            if UPCAST:  # (the interpreter's tl.dot returns garbage for bf16; the values are exact in fp32)
                acc = tl.dot(x.to(tl.float32), tl.trans(a.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(a), acc, input_precision=PREC)
        out = u_ptr + rows[:, None] * (J * R) + j * R + r[None, :]
        tl.store(out, acc.to(u_ptr.dtype.element_ty), mask=(rows < end)[:, None] & (r < R)[None, :])


class ExpertLora(NamedTuple):
    """Per-expert LoRA of one or two projections that read the same rows (gate then up): A [E, r, K] and B [E, N, r]
    each, and the scale s of s * B_e (A_e x)."""

    a: tuple[Tensor, ...]
    b: tuple[Tensor, ...]
    scale: float


def grouped_lora_a(x_sorted: Tensor, expert_offsets: Tensor, a: tuple[Tensor, ...]) -> Tensor:
    """u[row, j] = A_j[e] @ x_sorted[row] for the rows of each expert e (expert_offsets int [E + 1], grouped_gemm's
    contract), for one or two stacked A [E, r, K] in x's dtype. Returns u [T, len(a), r] in that dtype."""
    t, k = x_sorted.shape
    e, r, _ = a[0].shape
    if not 1 <= len(a) <= 2 or any(m.shape != (e, r, k) or m.dtype != x_sorted.dtype or m.stride() != a[0].stride()
                                   or m.stride(2) != 1 for m in a):  # fmt: skip
        raise ValueError(f"grouped_lora_a takes one or two A [E, r, K={k}] of one layout in {x_sorted.dtype}, got "
                         f"{[(tuple(m.shape), m.dtype) for m in a]}")
    if expert_offsets.numel() != e + 1:  # (the kernel reads E + 1 offsets; more experts in A would read past them)
        raise ValueError(f"grouped_lora_a: A has {e} experts but expert_offsets has {expert_offsets.numel()} entries; "
                         f"expected {e + 1}")
    u = torch.empty((t, len(a), r), dtype=x_sorted.dtype, device=x_sorted.device)
    if t == 0:
        return u
    x = x_sorted if x_sorted.stride(1) == 1 else x_sorted.contiguous()
    pdl = use_pdl(x.device)
    _lora_a_kernel[(max_row_tiles(t, _BM, e), len(a))](
        x, a[0], a[-1], u, expert_offsets, e, k, x.stride(0), a[0].stride(0), a[0].stride(1), J=len(a), R=r,
        R_POW2=max(16, triton.next_power_of_2(r)), BM=_BM, BK=_BK, E_POW2=triton.next_power_of_2(e),
        PREC=dot_precision(x.dtype), UPCAST=INTERPRETED and x.dtype == torch.bfloat16, PDL=pdl,
        launch_pdl=pdl, num_warps=4,
    )  # fmt: skip
    return u
