"""Where a packed matmul runs: fused Triton kernels on CUDA when they support the format and shape, else the
pure-torch reference (dequantize one weight, or one chunk of experts, transiently, then matmul)."""

from __future__ import annotations

from torch import Tensor

from .grouped import grouped_mm


def _kernels():
    try:
        from orbit_lightning import kernels
    except ImportError:  # triton missing (e.g. macOS): the reference path serves
        return None
    return kernels if hasattr(kernels, "dequant_linear") else None


def _use_kernels(x: Tensor, fmt_name: str) -> bool:
    k = _kernels()
    return x.is_cuda and k is not None and k.kernels_available(x.device) and k.supports(fmt_name)


def dequant_matmul(x: Tensor, layer) -> Tensor:
    """x [..., K] @ W^T -> [..., N] for a QuantLinear `layer`."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if _use_kernels(x2, layer.fmt.name):
        y = _kernels().dequant_linear(x2, layer.fmt, layer.packed())
    else:
        y = x2 @ layer.dequantize(x.dtype).t()
    return y.view(*shape[:-1], layer.out_features)


def dequant_matmul_dx(dy: Tensor, layer) -> Tensor:
    """dX = dY @ W: [..., N] -> [..., K], reading the same packed weight."""
    shape = dy.shape
    dy2 = dy.reshape(-1, shape[-1])
    if _use_kernels(dy2, layer.fmt.name):
        dx = _kernels().dequant_linear_dx(dy2, layer.fmt, layer.packed())
    else:
        dx = dy2 @ layer.dequantize(dy.dtype)
    return dx.view(*shape[:-1], layer.in_features)


def dequant_grouped(x: Tensor, experts, proj: str, expert_ids: Tensor, group_sizes: list[int]) -> Tensor:
    """Rows of x grouped by expert -> x_g @ W[e_g]^T; only the chunk's experts are dequantized."""
    w = experts.dequantize(proj, expert_ids, x.dtype)  # [c, N, K], freed when this returns
    return grouped_mm(x, w, group_sizes)


def dequant_grouped_dx(dy: Tensor, experts, proj: str, expert_ids: Tensor, group_sizes: list[int]) -> Tensor:
    w = experts.dequantize(proj, expert_ids, dy.dtype)
    return grouped_mm(dy, w.transpose(1, 2), group_sizes)

