"""fp8 e4m3 with 128x128 block scales: the DeepSeek-V3 checkpoint format.

Packed layout (every key keeps the leading `...` dims of the weight):
    weight            float8_e4m3fn [..., N, K]
    weight_scale_inv  float32       [..., ceil(N/128), ceil(K/128)]   one scale per 128x128 block
Dequantization: w[n, k] = float(weight[n, k]) * weight_scale_inv[n // 128, k // 128]. N and K need not be
multiples of 128: the last block row/column is partial, as in DeepSeek's `weight_dequant` and transformers'
`_dequantize_fp8_weight`.

Quantization (DeepSeek / transformers FineGrainedFP8): scale_inv = block_absmax / 448 (448 = e4m3fn max),
weight = e4m3(clamp(w / scale_inv, -448, 448)) with round-half-even. All-zero blocks get scale_inv = 1.
The scale is computed in float64 and rounded once to float32, so a weight dequantized in float64 re-quantizes
to the same bits (its block absmax is exactly 448 * scale_inv).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .registry import PackedShapes, QuantFormat, float_compute_dtype, register_format
from .synthetic import TARGET_STD, random_bytes, scale_jitter

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def _blocks(x: Tensor, block: tuple[int, int]) -> Tensor:
    """x: [..., N, K] -> zero-padded [..., N/bn, bn, K/bk, bk] (sizes rounded up to whole blocks)."""
    bn, bk = block
    n, k = x.shape[-2:]
    x = F.pad(x, (0, -k % bk, 0, -n % bn))
    return x.unflatten(-1, (-1, bk)).unflatten(-3, (-1, bn))


def expand_block_scales(scale: Tensor, n: int, k: int, block: tuple[int, int]) -> Tensor:
    """scale: [..., ceil(N/bn), ceil(K/bk)] -> [..., N, K], each scale repeated over its block."""
    full = scale.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return full[..., :n, :k]


@dataclass(frozen=True)
class Fp8BlockFormat(QuantFormat):
    block: tuple[int, int] = (128, 128)

    def __post_init__(self):
        if len(self.block) != 2 or min(self.block) <= 0:
            raise ValueError(f"fp8 block must be two positive sizes (rows, cols), got {self.block}")
        object.__setattr__(self, "block", tuple(int(b) for b in self.block))

    @property
    def name(self) -> str:
        return "fp8" if self.block == (128, 128) else f"fp8-b{self.block[0]}x{self.block[1]}"

    def packed_shapes(self, shape: tuple[int, ...]) -> PackedShapes:
        self.validate(shape)
        *lead, n, k = shape
        scale_shape = (*lead, math.ceil(n / self.block[0]), math.ceil(k / self.block[1]))
        return {
            "weight": ((*lead, n, k), torch.float8_e4m3fn),
            "weight_scale_inv": (scale_shape, torch.float32),
        }

    def quantize(self, w: Tensor) -> dict[str, Tensor]:
        self._check_input(w)
        n, k = w.shape[-2:]
        cdt = float_compute_dtype(w.dtype)
        absmax = _blocks(w, self.block).abs().amax(dim=(-3, -1))
        scale_inv = (absmax.to(torch.float64) / FP8_MAX).to(torch.float32)
        scale_inv = torch.where(absmax == 0, 1.0, scale_inv)
        x = w.to(cdt) / expand_block_scales(scale_inv, n, k, self.block).to(cdt)
        weight = x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return {"weight": weight, "weight_scale_inv": scale_inv}

    def dequantize(self, packed: dict[str, Tensor], dtype: torch.dtype = torch.bfloat16) -> Tensor:
        self._check_packed(packed, ("weight", "weight_scale_inv"))
        weight, scale_inv = packed["weight"], packed["weight_scale_inv"]
        cdt = float_compute_dtype(dtype)
        n, k = weight.shape[-2:]
        return (weight.to(cdt) * expand_block_scales(scale_inv.to(cdt), n, k, self.block)).to(dtype)

    def random_packed(self, shape, device="cpu", generator=None) -> dict[str, Tensor]:
        shapes = self.packed_shapes(shape)
        # e4m3 bits s.eeee.mmm: keep a random sign and mantissa, force the exponent field into 5..8, so values
        # are +-[0.25, 3.75] spread over four octaves (no NaN, no huge outliers).
        bits = random_bytes(shapes["weight"][0], device, generator)
        bits = (bits & 0x87) | ((((bits >> 3) & 0x3) + 5) << 3)
        weight = bits.view(torch.float8_e4m3fn)
        mean_sq = sum((2.0 ** (e - 7) * (1 + m / 8)) ** 2 for e in range(5, 9) for m in range(8)) / 32
        jitter, jitter_sq = scale_jitter(shapes["weight_scale_inv"][0], device, generator)
        scale_inv = jitter * (TARGET_STD / math.sqrt(mean_sq * jitter_sq))
        return {"weight": weight, "weight_scale_inv": scale_inv}


register_format("fp8")(Fp8BlockFormat)
