"""Batch-invariant row logsumexp: one program per row, fixed-size chunks in a fixed order.

torch's reductions pick their strategy (threads per row, rows per block, split across blocks) from the
tensor's shape, so a decode step's [B, V] logits and the trainer's [B*T, V] logits may reduce a row in
different orders. Here a row's result depends only on its own values and V.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_BLOCK = 2048  # fixed chunk: the reduction order depends on V only

_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _lse_kernel(x_ptr, out_ptr, V, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    # Per-lane running max and rescaled sum (online softmax), folded across lanes once at the end.
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        # Lanes that have seen only -inf keep m_new = -inf; guard the exp so they stay at 0, not NaN.
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp2((m - safe) * _LOG2E) + tl.exp2((x - safe) * _LOG2E)
        m = m_new
    top = tl.max(m, axis=0)
    safe_top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(s * tl.exp2((m - safe_top) * _LOG2E), axis=0)
    tl.store(out_ptr + row, safe_top + tl.log2(total) * _LN2)


def logsumexp(x: Tensor) -> Tensor:
    """log(sum(exp(x))) over the last dim, in fp32. x: [..., V] -> [...] float32."""
    v = x.shape[-1]
    x2 = x.reshape(-1, v)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    if x2.shape[0]:
        _lse_kernel[(x2.shape[0],)](x2, out, v, x2.stride(0), BLOCK=min(_BLOCK, triton.next_power_of_2(v)))
    return out.reshape(x.shape[:-1])
