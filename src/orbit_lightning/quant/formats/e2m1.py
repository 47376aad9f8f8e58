"""FP4 E2M1 element codes, shared by mxfp4 and nvfp4.

A code is 4 bits: bit 3 = sign, bits 2..1 = exponent (bias 1), bit 0 = mantissa. Codes 0..7 are
0, 0.5, 1, 1.5, 2, 3, 4, 6 and codes 8..15 their negatives (code 8 is -0). There is no inf/NaN.

Encoding saturates to +-6 and rounds to nearest, ties to even code (even mantissa bit), as the OCP MX spec and
torchao's `f32_to_f4_unpacked` do. On the magnitude grid the ties therefore go:
0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.
The sign is taken from the sign bit, so negative inputs that round to zero become code 8 (-0), like torchao.
"""

from __future__ import annotations

import torch
from torch import Tensor

E2M1_MAX = 6.0
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring magnitudes, split by where a tie goes: down when the lower code is even,
# up when it is odd.
_TIE_DOWN = (0.25, 1.25, 2.5, 5.0)
_TIE_UP = (0.75, 1.75, 3.5)


def e2m1_values(device=None, dtype: torch.dtype = torch.float32) -> Tensor:
    """The 16 code values, [16], indexed by code."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=dtype, device=device)
    return torch.cat([mags, -mags])


def encode_e2m1(x: Tensor) -> Tensor:
    """x: [...] float (already divided by its scale) -> [...] uint8 codes in [0, 15]."""
    mag = x.abs().clamp(max=E2M1_MAX)
    down = torch.tensor(_TIE_DOWN, dtype=mag.dtype, device=mag.device)
    up = torch.tensor(_TIE_UP, dtype=mag.dtype, device=mag.device)
    # index = #(midpoints passed): strictly above a tie-down midpoint, or at/above a tie-up one.
    code = torch.bucketize(mag, down, right=False) + torch.bucketize(mag, up, right=True)
    return (code.to(torch.uint8)) | (torch.signbit(x).to(torch.uint8) << 3)


def decode_e2m1(codes: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """codes: [...] uint8 in [0, 15] -> [...] values in `dtype`."""
    return e2m1_values(codes.device, dtype)[codes.long()]
