"""fp8 e4m3 with 128x128 block scales (DeepSeek-V3 layout), including partial edge blocks."""

import torch

from orbit_lightning.quant.formats import Fp8BlockFormat

B = 128


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02
    w[:B, :B] *= 10  # blocks with different ranges, so a mixed-up scale index shows
    return w


def test_scales_and_dequantize_against_block_loop():
    n, k = 130, 260  # 2 x 3 blocks, the last row / column of blocks partial
    fmt = Fp8BlockFormat()
    w = _weight(n, k, 0)
    packed = fmt.quantize(w)
    assert packed["weight"].dtype == torch.float8_e4m3fn and packed["weight"].shape == (n, k)
    assert packed["weight_scale_inv"].shape == (2, 3)
    expected = torch.empty(n, k, dtype=torch.float64)
    for bi in range(2):
        for bj in range(3):
            rows, cols = slice(bi * B, (bi + 1) * B), slice(bj * B, (bj + 1) * B)
            scale = packed["weight_scale_inv"][bi, bj].item()
            assert scale == torch.tensor(w[rows, cols].abs().max().double().item() / 448.0).float().item()
            expected[rows, cols] = packed["weight"][rows, cols].double() * scale
    assert torch.equal(fmt.dequantize(packed, torch.float64), expected)


def test_elementwise_error_is_one_e4m3_rounding():
    # e4m3 has 3 mantissa bits: rounding moves a normal value by at most 2^-4 of itself; below the
    # smallest normal (2^-6 in scaled units) the absolute step is 2^-9, so the error is <= 2^-10 * scale.
    fmt = Fp8BlockFormat()
    w = _weight(256, 384, 1)
    packed = fmt.quantize(w)
    deq = fmt.dequantize(packed, torch.float64)
    scale = packed["weight_scale_inv"].double().repeat_interleave(B, 0).repeat_interleave(B, 1)
    # (1 + 1e-6): w / scale is itself rounded to float32 before the e4m3 cast
    bound = torch.maximum(w.double().abs() * 2.0**-4, scale * 2.0**-10) * (1 + 1e-6)
    assert ((deq - w.double()).abs() <= bound).all()
    # the largest element of each block maps to +-448 exactly
    assert packed["weight"].float().abs().amax().item() == 448.0


def test_zero_block_has_unit_scale():
    w = torch.zeros(B + 5, B)
    w[B:] = 1.75  # absmax 1.75 -> scale 1.75 / 448 = 2^-8, exact
    packed = Fp8BlockFormat().quantize(w)
    assert packed["weight_scale_inv"][:, 0].tolist() == [1.0, 2.0**-8]
    assert torch.equal(Fp8BlockFormat().dequantize(packed, torch.float32), w)
