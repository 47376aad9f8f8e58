"""Input checks and masked reductions shared by the algorithms package (private)."""

from __future__ import annotations

import torch
from torch import Tensor


def compute_dtype(x: Tensor, name: str) -> torch.dtype:
    """The dtype to do maths in: at least float32.

    bf16/fp16 log-probs have 8/11 mantissa bits; exponentiating or summing their differences in that
    precision would swamp the ~1e-2 train/rollout gaps we need to see, so they are promoted. float64
    (used by the tests' references) stays float64.
    """
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got dtype {x.dtype}")
    return torch.promote_types(x.dtype, torch.float32)


def check_token_tensor(x: Tensor, name: str, shape: torch.Size) -> None:
    """Raise unless ``x`` has the [N, T] shape of the batch's token tensors."""
    if x.shape != shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)}; the token tensors are [N, T] = {tuple(shape)}")


def float_mask(mask: Tensor, shape: torch.Size, dtype: torch.dtype) -> Tensor:
    """Validate a 0/1 token mask (bool or float) of ``shape`` and return it as ``dtype``."""
    check_token_tensor(mask, "mask", shape)
    return mask.to(dtype)


def safe_denominator(count: Tensor) -> Tensor:
    """``count`` with zeros replaced by 1, so that an empty mask gives 0 (not NaN) and keeps its grad path."""
    return torch.where(count > 0, count, torch.ones_like(count))


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """Sum of ``x * mask``; masked-out entries are dropped with ``where``, so an inf/NaN there cannot leak."""
    picked = torch.where(mask > 0, x * mask, torch.zeros_like(x))
    return picked.sum() if dim is None else picked.sum(dim=dim, keepdim=keepdim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """Mean of ``x`` over the entries where ``mask`` counts; 0 where nothing counts."""
    count = mask.sum() if dim is None else mask.sum(dim=dim, keepdim=keepdim)
    return masked_sum(x, mask, dim, keepdim) / safe_denominator(count)


def check_groups(rewards: Tensor, group_size: int, valid: Tensor | None) -> tuple[Tensor, Tensor]:
    """Validate a flat group-contiguous reward vector and return (rewards [B, G], valid [B, G] bool).

    Rewards of invalid samples may be anything (NaN from a failed reward function is normal); rewards of
    valid samples must be finite.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N = B*G], got {tuple(rewards.shape)}; flatten the groups")
    if not rewards.is_floating_point():
        raise TypeError(f"rewards must be a floating tensor, got dtype {rewards.dtype}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    n = rewards.shape[0]
    if n % group_size != 0:
        raise ValueError(
            f"{n} rewards do not split into groups of {group_size}; "
            "rows g*G..g*G+G-1 must hold one prompt's G samples"
        )
    if valid is None:
        valid = torch.ones_like(rewards, dtype=torch.bool)
    elif valid.dtype != torch.bool or valid.shape != rewards.shape:
        raise ValueError(
            f"valid must be a bool tensor shaped like rewards {tuple(rewards.shape)}, "
            f"got {valid.dtype} {tuple(valid.shape)}"
        )
    if bool((valid & ~torch.isfinite(rewards)).any()):
        raise ValueError("some valid samples have non-finite rewards; mark failed samples False in `valid`")
    return rewards.view(-1, group_size), valid.view(-1, group_size)
