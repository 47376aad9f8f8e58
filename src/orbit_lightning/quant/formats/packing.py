"""Two 4-bit codes per uint8 along the last dim.

`even_low=True` (mxfp4, nvfp4; torchao's `pack_uint4` and the OCP/NVIDIA convention): byte j holds element 2j
in bits 0..3 and element 2j+1 in bits 4..7.
`even_low=False` (nf4; bitsandbytes' `quantize_4bit`): element 2j in bits 4..7, element 2j+1 in bits 0..3.
"""

from __future__ import annotations

import torch
from torch import Tensor


def pack_nibbles(codes: Tensor, even_low: bool = True) -> Tensor:
    """codes: [..., K] integer in [0, 15] -> [..., K/2] uint8."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles needs an even last dim, got shape {tuple(codes.shape)}")
    codes = codes.to(torch.uint8)
    even, odd = codes[..., 0::2], codes[..., 1::2]
    return (even | (odd << 4)) if even_low else ((even << 4) | odd)


def unpack_nibbles(packed: Tensor, even_low: bool = True) -> Tensor:
    """packed: [..., K/2] uint8 -> [..., K] uint8 codes in [0, 15]."""
    low, high = packed & 0x0F, packed >> 4
    pair = (low, high) if even_low else (high, low)
    return torch.stack(pair, dim=-1).flatten(-2)

