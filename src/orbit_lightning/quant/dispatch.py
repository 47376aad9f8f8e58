"""Where a packed matmul runs.

On CUDA, with the Triton kernels (`orbit_lightning.kernels`) supporting the format:
- few rows (decode, M <= FUSED_MAX_ROWS) or batch-invariant mode: the fused dequant-GEMM, which reads only the
  packed bytes and never writes a BF16 weight;
- many rows (prefill, training): the kernels' dequantizer writes the weight (or the chunk of experts) once in
  BF16, cuBLAS / grouped GEMM runs, and the tile is freed. On the H200 this beat the fused kernel from M ~ 128
  (bench/RESULTS.md); the transient is one weight or one expert chunk, as the design bounds it.
Elsewhere (CPU): the pure-torch reference dequantizer, then matmul.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .grouped import grouped_mm

FUSED_MAX_ROWS = 64


def _kernels():
    try:
        from orbit_lightning import kernels
    except ImportError:  # triton missing (e.g. macOS): the reference path serves
        return None
    return kernels


def _cuda_kernels(x: Tensor, fmt):
    if not x.is_cuda:
        return None
    k = _kernels()
    return k if k is not None and k.kernels_available(x.device) and k.supports(fmt) else None


def _fused(k, rows: int) -> bool:
    return rows <= FUSED_MAX_ROWS or k.is_batch_invariant()


def fused_grouped(fmt, rows: int, num_experts: int, device: torch.device) -> bool:
    """MoE: the fused grouped kernel wins while experts see few rows each (decode); it materializes nothing,
    so it takes all active experts in one launch. Large batches use chunked dequant + grouped GEMM."""
    if device.type != "cuda":
        return False
    k = _kernels()
    if k is None or not k.kernels_available(device) or not k.supports(fmt):
        return False
    return rows <= FUSED_MAX_ROWS * max(num_experts, 1) or k.is_batch_invariant()


def _dense_weight(layer, dtype: torch.dtype, k) -> Tensor:
    return k.dequantize(layer.fmt, layer.packed(), dtype) if k is not None else layer.dequantize(dtype)


def dequant_matmul(x: Tensor, layer) -> Tensor:
    """x [..., K] @ W^T -> [..., N] for a QuantLinear `layer`."""
    x2 = x.reshape(-1, x.shape[-1])
    k = _cuda_kernels(x2, layer.fmt)
    if k is not None and _fused(k, x2.shape[0]):
        y = k.dequant_linear(x2, layer.fmt, layer.packed())
    else:
        y = x2 @ _dense_weight(layer, x.dtype, k).t()
    return y.view(*x.shape[:-1], layer.out_features)


def dequant_matmul_dx(dy: Tensor, layer) -> Tensor:
    """dX = dY @ W: [..., N] -> [..., K], reading the same packed weight (no dW, no saved weight)."""
    dy2 = dy.reshape(-1, dy.shape[-1])
    k = _cuda_kernels(dy2, layer.fmt)
    if k is not None and _fused(k, dy2.shape[0]):
        dx = k.dequant_linear_dx(dy2, layer.fmt, layer.packed())
    else:
        dx = dy2 @ _dense_weight(layer, dy.dtype, k)
    return dx.view(*dy.shape[:-1], layer.in_features)


def _chunk_weights(experts, proj: str, expert_ids: Tensor, dtype: torch.dtype, k) -> Tensor:
    if k is None:
        return experts.dequantize(proj, expert_ids, dtype)  # [c, N, K]
    return k.dequantize(experts.fmt, experts.packed(proj), dtype, expert_ids=expert_ids)


def _offsets(experts, expert_ids: Tensor, group_sizes: list[int], device) -> Tensor:
    """[E+1] row offsets over all experts, rows only for the chunk's experts (the fused kernel's input)."""
    counts = torch.zeros(experts.num_experts, dtype=torch.int32, device=device)
    counts[expert_ids] = torch.tensor(group_sizes, dtype=torch.int32, device=device)
    return torch.cat([counts.new_zeros(1), counts.cumsum(0, dtype=torch.int32)])


def dequant_grouped(x: Tensor, experts, proj: str, expert_ids: Tensor, group_sizes: list[int]) -> Tensor:
    """Rows of x grouped by expert -> x_g @ W[e_g]^T; only the chunk's experts are read."""
    k = _cuda_kernels(x, experts.fmt)
    if k is not None and fused_grouped(experts.fmt, x.shape[0], len(group_sizes), x.device):
        off = _offsets(experts, expert_ids, group_sizes, x.device)
        return k.grouped_dequant_linear(x, off, experts.fmt, experts.packed(proj))
    return grouped_mm(x, _chunk_weights(experts, proj, expert_ids, x.dtype, k), group_sizes)


def dequant_grouped_dx(dy: Tensor, experts, proj: str, expert_ids: Tensor, group_sizes: list[int]) -> Tensor:
    k = _cuda_kernels(dy, experts.fmt)
    if k is not None and fused_grouped(experts.fmt, dy.shape[0], len(group_sizes), dy.device):
        off = _offsets(experts, expert_ids, group_sizes, dy.device)
        return k.grouped_dequant_linear_dx(dy, off, experts.fmt, experts.packed(proj))
    return grouped_mm(dy, _chunk_weights(experts, proj, expert_ids, dy.dtype, k).transpose(1, 2), group_sizes)
