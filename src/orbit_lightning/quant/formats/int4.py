"""int4, symmetric, group g along K: compressed-tensors "pack-quantized" (the layout Kimi-K2 ships).

Packed layout (every key keeps the leading `...` dims of the weight):
    weight_packed  int32    [..., N, K/8]   8 codes per int32; element 8i+j of a row is in bits 4j..4j+3 of
                                            word i (first element in the lowest bits), stored offset-binary as
                                            q + 8 in [0, 15]; words are two's-complement int32.
    weight_scale   bfloat16 [..., N, K/g]   w = q * scale
    weight_shape   int64    [..., 2]        (N, K) of each matrix, as compressed-tensors stores it.
                                            Informational: dequantize reads K from weight_packed (K is a
                                            multiple of g, so there is no padding) and never reads this
                                            tensor, which would cost a device sync.

Packing convention checked against compressed-tensors' `pack_to_int32` / `unpack_from_int32`
(vllm-project/compressed-tensors, compressors/quantized_compressors/pack_quantized.py): they add the
offset 1 << (num_bits - 1) = 8, group 32 // num_bits = 8 consecutive values along the row, shift value i
left by num_bits * i and sum into an int32; unpacking masks (w >> 4i) & 0xF and subtracts 8. Same as above.

Quantization follows compressed-tensors' symmetric int path (quantization/utils/helpers.py
`calculate_qparams`, lifecycle/forward.py `_quantize`): scale = absmax / ((q_max - q_min) / 2) = absmax / 7.5
(neither /7 nor /8), q = clamp(round(w / scale), -8, 7) with round-half-even. A group whose absmax is reached
by a negative weight uses code -8; a positive maximum rounds to 7.5 -> 8 and is clipped to 7. All-zero groups
get scale = bf16 eps (compressed-tensors' `_get_dtype_eps`) so nothing divides by zero.
One deliberate difference: w / scale is computed in float32 (compressed-tensors divides in the weight's
dtype), which only matters for exact rounding ties.

The /7.5 scale is not a fixed point (re-quantizing q * scale finds absmax 7 * scale or 8 * scale), so only
"codes given the stored scale" round-trip exactly, not the scale itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .registry import PackedShapes, QuantFormat, float_compute_dtype, get_format, register_format
from .synthetic import TARGET_STD, random_bytes, scale_jitter
from .tiled import tile_packed, tile_tensor, tiled_blocker, tiles, untile_packed, untile_tensor

INT4_GROUP_SIZES = (32, 64, 128)
_SCALE_DIVISOR = 7.5  # compressed-tensors: (q_max - q_min) / 2 = (7 - (-8)) / 2
_OFFSET = 8
_SHIFTS = tuple(4 * j for j in range(8))


def _as_int32(value: int) -> int:
    """The signed int32 with the same 32 bits as the unsigned `value`."""
    return value - 2**32 if value >= 2**31 else value


def pack_int4(q: Tensor) -> Tensor:
    """q: [..., K] integer codes in [-8, 7], K % 8 == 0 -> [..., K/8] int32."""
    words = (q.to(torch.int64) + _OFFSET).unflatten(-1, (-1, 8))
    shifts = torch.tensor(_SHIFTS, dtype=torch.int64, device=q.device)
    packed = (words << shifts).sum(-1)
    # Values >= 2^31 (bit 31 set) are stored as negative two's-complement int32.
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_int4(packed: Tensor) -> Tensor:
    """packed: [..., K/8] int32 -> [..., K] int8 codes in [-8, 7]."""
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # arithmetic shift; the mask drops the sign fill
    return (nibbles.flatten(-2) - _OFFSET).to(torch.int8)


def int4_scales(w: Tensor, group_size: int) -> Tensor:
    """w: [..., N, K] float -> [..., N, K/g] bfloat16 scales (absmax / 7.5, zero groups -> bf16 eps)."""
    absmax = w.unflatten(-1, (-1, group_size)).abs().amax(-1)
    scale = (absmax.to(float_compute_dtype(w.dtype)) / _SCALE_DIVISOR).to(torch.bfloat16)
    return torch.where(scale == 0, torch.finfo(torch.bfloat16).eps, scale)


def int4_codes(w: Tensor, scale: Tensor) -> Tensor:
    """w: [..., N, K] float, scale: [..., N, K/g] -> [..., N, K] int8 codes q = clamp(round(w / s), -8, 7)."""
    cdt = float_compute_dtype(w.dtype)
    x = w.to(cdt).unflatten(-1, (scale.shape[-1], -1)) / scale.to(cdt).unsqueeze(-1)
    return torch.round(x).clamp(-8, 7).flatten(-2).to(torch.int8)


@dataclass(frozen=True)
class Int4Format(QuantFormat):
    group_size: int = 32
    # Words and scales in tiled.py's block layout (the decode kernels' fast path) instead of row-major; the same
    # values. A weight whose shape cannot be tiled is stored row-major (for_shape).
    tiled: bool = False

    def __post_init__(self):
        if self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group_size must be one of {INT4_GROUP_SIZES}, got {self.group_size}")

    @property
    def name(self) -> str:
        return ("int4" if self.group_size == 32 else f"int4-g{self.group_size}") + ("-tiled" if self.tiled else "")

    def validate(self, shape: tuple[int, ...]) -> None:
        super().validate(shape)
        if shape[-1] % self.group_size:
            raise ValueError(
                f"{self.name}: K = {shape[-1]} (in features) is not a multiple of the group size "
                f"{self.group_size}; pick a group size that divides K or keep this layer in bf16"
            )
        why = tiled_blocker(tuple(shape), self.group_size) if self.tiled else None
        if why:
            raise ValueError(f"{self.name}: a weight of shape {tuple(shape)} cannot be tiled ({why}); store it as "
                             f"{self.for_shape(shape).name}")

    def for_shape(self, shape: tuple[int, ...]) -> Int4Format:
        if self.tiled and tiled_blocker(tuple(shape), self.group_size):
            return Int4Format(self.group_size)
        return self

    def to_storage(self, key: str, tensor: Tensor) -> Tensor:
        # A tensor of a shape no tiled weight has is passed on as it is, for the caller's shape check to name.
        return tile_tensor(key, tensor) if self.tiled and tiles(key, tensor) else tensor

    def from_storage(self, key: str, tensor: Tensor) -> Tensor:
        return untile_tensor(key, tensor) if self.tiled else tensor

    def same_values(self, other: QuantFormat) -> bool:
        return isinstance(other, Int4Format) and other.group_size == self.group_size

    def packed_shapes(self, shape: tuple[int, ...]) -> PackedShapes:
        self.validate(shape)
        *lead, n, k = shape
        return {
            "weight_packed": ((*lead, n, k // 8), torch.int32),
            "weight_scale": ((*lead, n, k // self.group_size), torch.bfloat16),
            "weight_shape": ((*lead, 2), torch.int64),
        }

    def quantize(self, w: Tensor) -> dict[str, Tensor]:
        self._check_input(w)
        scale = int4_scales(w, self.group_size)
        *lead, n, k = w.shape
        weight_shape = torch.tensor([n, k], dtype=torch.int64, device=w.device).expand(*lead, 2)
        return self._stored({
            "weight_packed": pack_int4(int4_codes(w, scale)),
            "weight_scale": scale,
            "weight_shape": weight_shape.contiguous(),
        })

    def _stored(self, row_major: dict[str, Tensor]) -> dict[str, Tensor]:
        return tile_packed(row_major) if self.tiled else row_major

    def dequantize(self, packed: dict[str, Tensor], dtype: torch.dtype = torch.bfloat16) -> Tensor:
        self._check_packed(packed, ("weight_packed", "weight_scale"))
        if self.tiled:
            packed = untile_packed({k: packed[k] for k in ("weight_packed", "weight_scale")})
        cdt = float_compute_dtype(dtype)
        scale = packed["weight_scale"].to(cdt)
        q = unpack_int4(packed["weight_packed"]).to(cdt).unflatten(-1, (scale.shape[-1], -1))
        return (q * scale.unsqueeze(-1)).flatten(-2).to(dtype)

    def random_packed(self, shape, device="cpu", generator=None) -> dict[str, Tensor]:
        self.validate(shape)
        *lead, n, k = shape
        # Uniform random words give uniform codes q in [-8, 7] (mean -1/2). Mapping every stored nibble 0
        # (q = -8) to 8 (q = 0) makes them symmetric: q = 0 with probability 2/16, +-1..+-7 with 1/16 each.
        # Done word by word, so nothing larger than the packed tensor is allocated.
        words = random_bytes((*lead, n, k // 2), device, generator).view(torch.int32)
        for shift in _SHIFTS:
            high_bit = _as_int32(8 << shift)
            words = torch.where(((words >> shift) & 0xF) == 0, words | high_bit, words)
        mean_sq = 2 * sum(i * i for i in range(1, 8)) / 16  # E[q^2] = 17.5
        jitter, jitter_sq = scale_jitter((*lead, n, k // self.group_size), device, generator)
        scale = (jitter * (TARGET_STD / math.sqrt(mean_sq * jitter_sq))).to(torch.bfloat16)
        weight_shape = torch.tensor([n, k], dtype=torch.int64, device=device).expand(*lead, 2)
        return self._stored({"weight_packed": words, "weight_scale": scale, "weight_shape": weight_shape.contiguous()})


register_format("int4")(Int4Format)
for _fmt in [Int4Format(g, tiled) for g in INT4_GROUP_SIZES for tiled in (False, True)][1:]:
    register_format(_fmt.name)(lambda fmt=_fmt: fmt)


INT4_LAYOUTS = ("auto", "row-major", "tiled")


def int4_storage_name(fmt_name: str | None, layout: str, device: torch.device) -> str | None:
    """The format a model asked for as `fmt_name` is stored as under `layout` (model.int4_layout) on `device`.

    "auto" stores int4 tiled on CUDA, where the decode kernels read the tiled blocks 8-10 % faster at 1-16 rows and
    no slower at 64-4096 rows or in the MoE kernels (H100, bench/RESULTS.md, forty-first session), and row-major
    elsewhere (the CPU paths gain nothing from it). An explicit `int4*-tiled` name is kept; other formats pass."""
    if layout not in INT4_LAYOUTS:
        raise ValueError(f"model.int4_layout={layout!r}: expected one of {', '.join(INT4_LAYOUTS)}")
    fmt = get_format(fmt_name) if fmt_name is not None else None
    if not isinstance(fmt, Int4Format):
        if layout == "tiled":
            raise ValueError(f"model.int4_layout=tiled applies to int4 formats, not quant={fmt_name!r}; leave it at "
                             f"auto or pick an int4 format")
        return fmt_name
    if fmt.tiled and layout == "row-major":
        raise ValueError(f"quant={fmt_name!r} names the tiled layout but model.int4_layout=row-major; use "
                         f"quant={Int4Format(fmt.group_size).name!r} for row-major storage")
    tiled = fmt.tiled or layout == "tiled" or (layout == "auto" and device.type == "cuda")
    return Int4Format(fmt.group_size, tiled).name
