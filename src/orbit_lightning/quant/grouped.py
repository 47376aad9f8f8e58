"""Grouped GEMM over contiguous row groups: y[rows of g] = x[rows of g] @ w[g]^T.

On CUDA in bf16 it uses torch's grouped GEMM (`torch.nn.functional.grouped_mm` in newer torch,
`torch._grouped_mm` in older); elsewhere a per-group matmul, which is exact and fine for small CPU models.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _can_use_fused(x: Tensor, w: Tensor) -> bool:
    # torch's grouped GEMM wants bf16 on sm90+ and 16-byte aligned rows.
    return (
        _GROUPED_MM is not None
        and x.is_cuda
        and x.dtype == torch.bfloat16
        and w.dtype == torch.bfloat16
        and x.shape[-1] % 8 == 0
        and w.shape[1] % 8 == 0
        and torch.cuda.get_device_capability(x.device)[0] >= 9
    )


def grouped_mm(x: Tensor, w: Tensor, group_sizes: list[int]) -> Tensor:
    """x [M, K] rows grouped contiguously, w [G, N, K], sum(group_sizes) == M -> [M, N]."""
    if x.shape[0] == 0:
        return x.new_zeros(0, w.shape[1])
    if _can_use_fused(x, w):
        offs = torch.tensor(group_sizes, device=x.device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        return _GROUPED_MM(x, w.transpose(1, 2), offs=offs)
    outs = [xg @ wg.t() for xg, wg in zip(x.split(group_sizes), w, strict=True)]
    return torch.cat(outs) if outs else x.new_zeros(0, w.shape[1])
