"""Packed-weight storage shared by quantized linears and experts: buffers named as in the checkpoint format.

A packed weight of logical shape [..., N, K] is a handful of buffers (e.g. `weight_packed`, `weight_scale`,
`weight_shape` for int4). Frozen: buffers, never Parameters, so optimizers and `.grad` never see them.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .formats import QuantFormat


def register_packed(module: nn.Module, fmt: QuantFormat, shape: tuple[int, ...], prefix: str = "") -> None:
    fmt.validate(shape)
    for key, (kshape, dtype) in fmt.packed_shapes(shape).items():
        module.register_buffer(prefix + key, torch.empty(kshape, dtype=dtype))


def packed_tensors(module: nn.Module, fmt: QuantFormat, shape: tuple[int, ...], prefix: str = "") -> dict[str, Tensor]:
    return {key: getattr(module, prefix + key) for key in fmt.packed_shapes(shape)}


@torch.no_grad()
def store_packed(module: nn.Module, packed: dict[str, Tensor], prefix: str = "", index: int | None = None,
                 key_for_errors: str = "") -> None:
    """Copy packed tensors into the module's buffers (all of them, or one leading index, e.g. an expert)."""
    for key, value in packed.items():
        target = getattr(module, prefix + key, None)
        if target is None:
            raise ValueError(f"{key_for_errors}: {type(module).__name__} has no packed tensor {prefix + key!r}")
        if index is not None:
            target = target[index]
        if tuple(target.shape) != tuple(value.shape):
            raise ValueError(f"{key_for_errors}: packed {key} shape {tuple(value.shape)} != expected "
                             f"{tuple(target.shape)}; is the checkpoint for the same model and format?")
        target.copy_(value)
