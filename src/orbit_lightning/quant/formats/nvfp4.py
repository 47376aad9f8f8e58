"""nvfp4: fp4 e2m1 elements, an e4m3 scale per 16 consecutive elements along K, a float32 scale per matrix.

Packed layout (every key keeps the leading `...` dims of the weight):
    weight_packed        uint8         [..., N, K/2]    two e2m1 codes per byte, element 2j in bits 0..3
                                                        (same nibble order as mxfp4; codes in e2m1.py)
    weight_scale         float8_e4m3fn [..., N, K/16]   block scale
    weight_global_scale  float32       [...]            one per matrix (per expert); a 0-dim tensor for a
                                                        plain [N, K] weight
Dequantization: w = e2m1(code) * float(weight_scale) * weight_global_scale.

Quantization follows torchao (torchao/prototype/mx_formats/nvfp4_tensor.py `per_tensor_amax_to_scale` and
`nvfp4_quantize`): global = absmax / (448 * 6) per matrix, block scale = e4m3(clamp(block_absmax / 6 / global,
2^-6, 448)) (2^-6 = torchao's E4M3_EPS, the smallest normal e4m3), elements = e2m1(clamp(w / (scale * global),
-6, 6)) with round-half-even. All-zero matrices get global = 1.
Convention note: compressed-tensors' "nvfp4-pack-quantized" checkpoints store the reciprocal,
weight_global_scale = 448 * 6 / absmax, and divide by it; a loader for those must invert it.
The global scale is computed in float64 and rounded once to float32, so a weight dequantized in float64
re-quantizes to the same bits (the largest code of every non-clamped block is 6, which recovers its scale).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .e2m1 import E2M1_MAX, decode_e2m1, encode_e2m1
from .fp8 import FP8_MAX
from .packing import pack_nibbles, unpack_nibbles
from .registry import PackedShapes, QuantFormat, float_compute_dtype, register_format
from .synthetic import TARGET_STD, random_bytes, scale_jitter

NV_BLOCK = 16
E4M3_MIN_NORMAL = 2.0**-6


@dataclass(frozen=True)
class NVFP4Format(QuantFormat):
    name = "nvfp4"

    def validate(self, shape: tuple[int, ...]) -> None:
        super().validate(shape)
        if shape[-1] % NV_BLOCK:
            raise ValueError(
                f"nvfp4: K = {shape[-1]} (in features) is not a multiple of the NVFP4 block size {NV_BLOCK}; "
                "keep this layer in bf16"
            )

    def packed_shapes(self, shape: tuple[int, ...]) -> PackedShapes:
        self.validate(shape)
        *lead, n, k = shape
        return {
            "weight_packed": ((*lead, n, k // 2), torch.uint8),
            "weight_scale": ((*lead, n, k // NV_BLOCK), torch.float8_e4m3fn),
            "weight_global_scale": (tuple(lead), torch.float32),
        }

    def quantize(self, w: Tensor) -> dict[str, Tensor]:
        self._check_input(w)
        cdt = float_compute_dtype(w.dtype)
        blocks = w.to(cdt).unflatten(-1, (-1, NV_BLOCK))
        block_absmax = blocks.abs().amax(-1)  # [..., N, K/16]
        absmax = block_absmax.amax(dim=(-2, -1)).to(torch.float64)  # [...]
        global_scale = torch.where(absmax > 0, absmax / (FP8_MAX * E2M1_MAX), 1.0).to(torch.float32)
        g = global_scale.to(cdt)[..., None, None]
        scale = (block_absmax / E2M1_MAX / g).clamp(E4M3_MIN_NORMAL, FP8_MAX).to(torch.float8_e4m3fn)
        x = blocks / (scale.to(cdt) * g).unsqueeze(-1)
        return {
            "weight_packed": pack_nibbles(encode_e2m1(x.flatten(-2))),
            "weight_scale": scale,
            "weight_global_scale": global_scale,
        }

    def dequantize(self, packed: dict[str, Tensor], dtype: torch.dtype = torch.bfloat16) -> Tensor:
        self._check_packed(packed, ("weight_packed", "weight_scale", "weight_global_scale"))
        cdt = float_compute_dtype(dtype)
        values = decode_e2m1(unpack_nibbles(packed["weight_packed"]), cdt).unflatten(-1, (-1, NV_BLOCK))
        scale = packed["weight_scale"].to(cdt) * packed["weight_global_scale"].to(cdt)[..., None, None]
        return (values * scale.unsqueeze(-1)).flatten(-2).to(dtype)

    def random_packed(self, shape, device="cpu", generator=None) -> dict[str, Tensor]:
        shapes = self.packed_shapes(shape)
        # Uniform bytes: every e2m1 code equally likely, E[c^2] = 68.5 / 8 (see mxfp4). Block scales sit
        # around 256 in e4m3 (well inside its normal range) and the global scale brings the std to target.
        packed = random_bytes(shapes["weight_packed"][0], device, generator)
        jitter, jitter_sq = scale_jitter(shapes["weight_scale"][0], device, generator)
        scale = (256.0 * jitter).to(torch.float8_e4m3fn)
        global_value = TARGET_STD / (256.0 * math.sqrt(68.5 / 8 * jitter_sq))
        global_scale = torch.full(shapes["weight_global_scale"][0], global_value, device=device)
        return {"weight_packed": packed, "weight_scale": scale, "weight_global_scale": global_scale}


register_format("nvfp4")(NVFP4Format)
