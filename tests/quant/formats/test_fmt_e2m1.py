"""FP4 e2m1 codes and nibble packing (shared by mxfp4 / nvfp4 / nf4)."""

import torch

from orbit_lightning.quant.formats import decode_e2m1, e2m1_values, encode_e2m1, pack_nibbles, unpack_nibbles

# OCP MX spec table: code -> value (sign bit 3, exponent bits 2..1 with bias 1, mantissa bit 0).
SPEC_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _spec_value(code: int) -> float:
    sign = -1.0 if code & 8 else 1.0
    exp, man = (code >> 1) & 3, code & 1
    mag = man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1 + man / 2)  # subnormal when exp == 0
    return sign * mag


def test_codebook_matches_bit_definition():
    assert [_spec_value(c) for c in range(16)] == SPEC_VALUES
    assert e2m1_values().tolist() == SPEC_VALUES


def test_every_code_survives_decode_encode():
    codes = torch.arange(16, dtype=torch.uint8)
    values = decode_e2m1(codes)
    assert torch.equal(encode_e2m1(values), codes)  # including -0 -> code 8
    assert torch.equal(torch.signbit(values), codes >= 8)


def _reference_encode(x: float) -> int:
    """Nearest code value, ties to the even code (even mantissa bit), saturating at +-6."""
    mag = min(abs(x), 6.0)
    best = min(range(8), key=lambda c: (abs(_spec_value(c) - mag), c & 1))
    return best | (8 if torch.signbit(torch.tensor(x)) else 0)


def test_round_to_nearest_even_and_saturation():
    # every midpoint (the tie cases), points just around them, exact values and out-of-range values
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    xs = [m + d for m in mids for d in (-1e-3, 0.0, 1e-3)] + [0.0, 0.5, 6.0, 6.5, 7.0, 1e4]
    xs += [-x for x in xs]
    got = encode_e2m1(torch.tensor(xs)).tolist()
    assert got == [_reference_encode(x) for x in xs]
    # spot-check the ties by hand: ties go to 0, 1, 1, 2, 2, 4, 4
    assert encode_e2m1(torch.tensor(mids)).tolist() == [0, 2, 2, 4, 4, 6, 6]


def test_nibble_order():
    codes = torch.tensor([[0x1, 0x2, 0xA, 0xF]], dtype=torch.uint8)
    assert pack_nibbles(codes).tolist() == [[0x21, 0xFA]]  # element 2j in the low nibble
    assert pack_nibbles(codes, even_low=False).tolist() == [[0x12, 0xAF]]  # bitsandbytes order
    for even_low in (True, False):
        all_bytes = torch.arange(256, dtype=torch.uint8).view(4, 64)
        assert torch.equal(pack_nibbles(unpack_nibbles(all_bytes, even_low), even_low), all_bytes)
