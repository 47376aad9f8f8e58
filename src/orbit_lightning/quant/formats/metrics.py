"""Quantization error and storage cost of the formats, and a comparison table over all of them."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .registry import FORMATS, QuantFormat, get_format


def quantization_error(w: Tensor, fmt: QuantFormat | str) -> dict[str, float]:
    """w: [..., N, K] float -> rel_fro = ||deq - w||_F / ||w||_F, max_abs = max |deq - w| (in float64)."""
    fmt = get_format(fmt)
    w64 = w.to(torch.float64)
    err = fmt.dequantize(fmt.quantize(w), dtype=torch.float64) - w64
    return {"rel_fro": (err.norm() / w64.norm()).item(), "max_abs": err.abs().max().item()}


def bytes_per_param(fmt: QuantFormat | str, shape: tuple[int, ...]) -> float:
    """Packed bytes (codes + scales + metadata) per weight element; bf16 is 2."""
    return get_format(fmt).nbytes(shape) / math.prod(shape)


def value_formats() -> list[str]:
    """The registered formats but the storage layouts of another's values (int4-tiled: int4's), sorted."""
    return [name for name in sorted(FORMATS) if not getattr(get_format(name), "tiled", False)]


def print_error_table(
    shape: tuple[int, int] = (1024, 4096), std: float = 0.02, seed: int = 0, specs: list[str] | None = None
) -> str:
    """Quantize one N(0, std) weight with every registered format; print and return the table."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * std
    header = f"{'format':<10} {'bytes/param':>11} {'rel_fro':>9} {'max_abs':>10}"
    lines = [f"weight {tuple(shape)} ~ N(0, {std}), seed {seed}", header]
    for spec in specs or value_formats():
        err, size = quantization_error(w, spec), bytes_per_param(spec, shape)
        lines.append(f"{spec:<10} {size:>11.4f} {err['rel_fro']:>9.4f} {err['max_abs']:>10.2e}")
    table = "\n".join(lines)
    print(table)
    return table
