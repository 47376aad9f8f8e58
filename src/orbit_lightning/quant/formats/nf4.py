"""nf4 (QLoRA NormalFloat4) in pure torch, byte-compatible with bitsandbytes' unnested nf4.

Packed layout (every key keeps the leading `...` dims of the weight):
    weight_packed  uint8   [..., N, K/2]    two 4-bit codebook indices per byte: element 2j in bits 4..7,
                                            2j+1 in bits 0..3 (bitsandbytes' order, the opposite of
                                            mxfp4/nvfp4)
    weight_absmax  float32 [..., N, K/64]   absmax of each block of 64 consecutive elements along K
Dequantization: w = NF4_CODEBOOK[index] * absmax.

Decision: no bitsandbytes dependency. The codebook and rules below are bitsandbytes' reference path
(bitsandbytes/backends/default/ops.py `quantize_4bit` / `_dequantize_4bit_impl`, codebook in
bitsandbytes/backends/utils.py): blocks of 64 over the flattened tensor, x = clamp(w / absmax, -1, 1),
index = nearest codebook entry (bitsandbytes' argmin; here via midpoints, in float32), even elements in the
high nibble. Because K is a multiple of 64,
blocks never straddle rows, so for a 2-D weight `weight_packed.flatten()` and `weight_absmax.flatten()` are
exactly bitsandbytes' packed bytes and absmax; double quantization (nested absmax) is not supported.
All-zero blocks get absmax 0, which decodes to 0 (the codebook has an exact 0 at index 7).
Re-quantizing a dequantized weight gives the same bits: each block keeps its absmax (the codebook has +-1) and
code * absmax / absmax lands back on the code, far from any midpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .packing import pack_nibbles, unpack_nibbles
from .registry import PackedShapes, QuantFormat, float_compute_dtype, register_format
from .synthetic import TARGET_STD, random_bytes, scale_jitter

NF4_BLOCK = 64
# Normal-quantile levels of QLoRA (Dettmers et al. 2023), as float32 values, index = code.
NF4_CODEBOOK = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip


def nf4_codebook(device=None, dtype: torch.dtype = torch.float32) -> Tensor:
    """[16] codebook values (float32 values, cast to `dtype`)."""
    return torch.tensor(NF4_CODEBOOK, dtype=torch.float32, device=device).to(dtype)


@dataclass(frozen=True)
class NF4Format(QuantFormat):
    name = "nf4"

    def validate(self, shape: tuple[int, ...]) -> None:
        super().validate(shape)
        if shape[-1] % NF4_BLOCK:
            raise ValueError(
                f"nf4: K = {shape[-1]} (in features) is not a multiple of the nf4 block size {NF4_BLOCK}; "
                "keep this layer in bf16"
            )

    def packed_shapes(self, shape: tuple[int, ...]) -> PackedShapes:
        self.validate(shape)
        *lead, n, k = shape
        return {
            "weight_packed": ((*lead, n, k // 2), torch.uint8),
            "weight_absmax": ((*lead, n, k // NF4_BLOCK), torch.float32),
        }

    def quantize(self, w: Tensor) -> dict[str, Tensor]:
        self._check_input(w)
        cdt = float_compute_dtype(w.dtype)
        blocks = w.to(cdt).unflatten(-1, (-1, NF4_BLOCK))
        absmax = blocks.abs().amax(-1).to(torch.float32)
        safe = torch.where(absmax > 0, absmax, 1.0).to(cdt)
        x = (blocks / safe.unsqueeze(-1)).clamp(-1, 1).flatten(-2)
        # Nearest codebook entry via the 15 midpoints (equivalent to argmin; a tie goes to the lower index).
        code = nf4_codebook(w.device, cdt)
        index = torch.bucketize(x, (code[1:] + code[:-1]) / 2, right=False)
        return {"weight_packed": pack_nibbles(index, even_low=False), "weight_absmax": absmax}

    def dequantize(self, packed: dict[str, Tensor], dtype: torch.dtype = torch.bfloat16) -> Tensor:
        self._check_packed(packed, ("weight_packed", "weight_absmax"))
        cdt = float_compute_dtype(dtype)
        index = unpack_nibbles(packed["weight_packed"], even_low=False)
        values = nf4_codebook(index.device, cdt)[index.long()].unflatten(-1, (-1, NF4_BLOCK))
        return (values * packed["weight_absmax"].to(cdt).unsqueeze(-1)).flatten(-2).to(dtype)

    def random_packed(self, shape, device="cpu", generator=None) -> dict[str, Tensor]:
        shapes = self.packed_shapes(shape)
        # Uniform bytes: every codebook entry equally likely, which is what nf4 is designed for (equal-mass
        # normal quantiles); E[c^2] is the codebook's mean square.
        packed = random_bytes(shapes["weight_packed"][0], device, generator)
        mean_sq = sum(c * c for c in NF4_CODEBOOK) / 16
        jitter, jitter_sq = scale_jitter(shapes["weight_absmax"][0], device, generator)
        absmax = jitter * (TARGET_STD / math.sqrt(mean_sq * jitter_sq))
        return {"weight_packed": packed, "weight_absmax": absmax}


register_format("nf4")(NF4Format)
