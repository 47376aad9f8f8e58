"""mxfp4 (OCP Microscaling v1.0): fp4 e2m1 elements with one e8m0 scale per 32 consecutive elements along K.

Packed layout (every key keeps the leading `...` dims of the weight):
    weight_packed  uint8 [..., N, K/2]    two e2m1 codes per byte: element 2j in bits 0..3, 2j+1 in
                                          bits 4..7 (codes in e2m1.py)
    weight_scale   uint8 [..., N, K/32]   e8m0 biased exponent e: scale = 2^(e - 127); 255 (NaN) is
                                          never written
Dequantization: w = e2m1(code) * 2^(e - 127).

Quantization follows the OCP spec section 6.3 and torchao's default `ScaleCalculationMode.FLOOR`
(torchao/prototype/mx_formats/mx_tensor.py `to_mx`): shared exponent = floor(log2(block_absmax)) - 2
(2 = emax of e2m1, whose largest power of two is 4), clamped to [-127, 127]; elements are w / 2^exp
saturated to +-6 and rounded to nearest even. floor(log2) is taken with frexp, which also handles a
subnormal absmax (torchao reads the fp32 exponent bits, treating subnormals as 2^-127; irrelevant for real
weights). All-zero blocks get the smallest exponent (byte 0).
The scale is a power of two, so dequantization is exact in bf16 and re-quantizing a dequantized weight gives
the same bits: a block's largest code is always 4 or 6, so its exponent is recovered.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .e2m1 import decode_e2m1, encode_e2m1
from .packing import pack_nibbles, unpack_nibbles
from .registry import PackedShapes, QuantFormat, float_compute_dtype, register_format
from .synthetic import TARGET_STD, random_bytes

MX_BLOCK = 32
E8M0_BIAS = 127
_E2M1_EMAX = 2


def mx_exponent(absmax: Tensor) -> Tensor:
    """absmax: [...] float -> [...] int32 unbiased shared exponent floor(log2(absmax)) - 2 in [-127, 127]."""
    _, exp = torch.frexp(absmax)  # absmax = m * 2^exp with m in [0.5, 1)  =>  floor(log2) = exp - 1
    shared = torch.where(absmax > 0, exp - 1 - _E2M1_EMAX, -E8M0_BIAS)
    return shared.clamp(-E8M0_BIAS, E8M0_BIAS).to(torch.int32)


def e8m0_to_float(scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """scale: [...] uint8 biased exponents -> [...] 2^(e - 127) in `dtype` (exact: exp2 of an integer)."""
    return torch.exp2(scale.to(dtype) - E8M0_BIAS)


@dataclass(frozen=True)
class MXFP4Format(QuantFormat):
    name = "mxfp4"

    def validate(self, shape: tuple[int, ...]) -> None:
        super().validate(shape)
        if shape[-1] % MX_BLOCK:
            raise ValueError(
                f"mxfp4: K = {shape[-1]} (in features) is not a multiple of the MX block size {MX_BLOCK}; "
                "keep this layer in bf16 or use a format with a smaller block"
            )

    def packed_shapes(self, shape: tuple[int, ...]) -> PackedShapes:
        self.validate(shape)
        *lead, n, k = shape
        return {
            "weight_packed": ((*lead, n, k // 2), torch.uint8),
            "weight_scale": ((*lead, n, k // MX_BLOCK), torch.uint8),
        }

    def quantize(self, w: Tensor) -> dict[str, Tensor]:
        self._check_input(w)
        blocks = w.to(float_compute_dtype(w.dtype)).unflatten(-1, (-1, MX_BLOCK))
        exp = mx_exponent(blocks.abs().amax(-1))
        # Multiplying by 2^-exp is exact; like torchao, never divide by a subnormal scale (below 2^-126).
        x = blocks * torch.exp2(-exp.clamp(min=-126).to(blocks.dtype)).unsqueeze(-1)
        return {
            "weight_packed": pack_nibbles(encode_e2m1(x.flatten(-2))),
            "weight_scale": (exp + E8M0_BIAS).to(torch.uint8),
        }

    def dequantize(self, packed: dict[str, Tensor], dtype: torch.dtype = torch.bfloat16) -> Tensor:
        self._check_packed(packed, ("weight_packed", "weight_scale"))
        cdt = float_compute_dtype(dtype)
        values = decode_e2m1(unpack_nibbles(packed["weight_packed"]), cdt).unflatten(-1, (-1, MX_BLOCK))
        return (values * e8m0_to_float(packed["weight_scale"], cdt).unsqueeze(-1)).flatten(-2).to(dtype)

    def random_packed(self, shape, device="cpu", generator=None) -> dict[str, Tensor]:
        shapes = self.packed_shapes(shape)
        # Uniform bytes: every e2m1 code equally likely, E[c^2] = (0 + .25 + 1 + 2.25 + 4 + 9 + 16 + 36) / 8.
        packed = random_bytes(shapes["weight_packed"][0], device, generator)
        mean_sq = 68.5 / 8
        # Scales are powers of two: mix the two exponents around the target so that E[s^2] * E[c^2] = std^2.
        target_sq = TARGET_STD**2 / mean_sq
        lo = math.floor(math.log2(target_sq) / 2)
        p_lo = (4.0 ** (lo + 1) - target_sq) / (4.0 ** (lo + 1) - 4.0**lo)
        pick_lo = torch.rand(shapes["weight_scale"][0], device=device, generator=generator) < p_lo
        exp = torch.where(pick_lo, lo, lo + 1)
        return {"weight_packed": packed, "weight_scale": (exp + E8M0_BIAS).to(torch.uint8)}


register_format("mxfp4")(MXFP4Format)
