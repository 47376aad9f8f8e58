"""Helpers for `random_packed`: packed weights drawn directly as bits, never via a dense float weight."""

from __future__ import annotations

import torch
from torch import Tensor

TARGET_STD = 0.02  # typical init / trained-weight scale of LLM linears


def random_bytes(shape: tuple[int, ...], device, generator: torch.Generator | None) -> Tensor:
    """Uniform random uint8 of `shape` (every bit pattern equally likely)."""
    return torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=generator)


def scale_jitter(shape: tuple[int, ...], device, generator: torch.Generator | None) -> tuple[Tensor, float]:
    """Per-block multipliers u ~ U(0.75, 1.25) (float32) and their E[u^2] = 1 + 0.5^2/12.

    Scales vary from block to block, so a kernel that reads the wrong scale is caught, while the expected
    weight std stays known in closed form."""
    u = 0.75 + 0.5 * torch.rand(shape, device=device, generator=generator)
    return u, 1.0 + 0.25 / 12.0
