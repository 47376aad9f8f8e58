"""nf4 in pure torch, in bitsandbytes' byte layout."""

import torch

from orbit_lightning.quant.formats import NF4Format

# QLoRA's NF4 levels as bitsandbytes ships them (index = code)
CODEBOOK = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
]  # fmt: skip


def test_quantize_and_dequantize_match_python_reference():
    w = torch.randn(2, 128, generator=torch.Generator().manual_seed(0)) * 0.02
    packed = NF4Format().quantize(w)
    absmax = packed["weight_absmax"].tolist()
    expected_idx, expected_w = [], []
    for n in range(2):
        for k in range(128):
            a = absmax[n][k // 64]
            assert a == w[n, (k // 64) * 64 : (k // 64 + 1) * 64].abs().max().item()
            x = w[n, k].item() / a
            idx = min(range(16), key=lambda i: abs(x - CODEBOOK[i]))  # bitsandbytes: argmin
            expected_idx.append(idx)
            expected_w.append(CODEBOOK[idx] * a)
    # bitsandbytes order: element 2j in the high nibble
    got = packed["weight_packed"].flatten().tolist()
    assert got == [(expected_idx[2 * j] << 4) | expected_idx[2 * j + 1] for j in range(128)]
    # the levels are float32 values, so level * float32 absmax is exact in float64
    assert NF4Format().dequantize(packed, torch.float64).flatten().tolist() == expected_w

def test_zero_block_decodes_to_zero():
    packed = NF4Format().quantize(torch.zeros(1, 64))
    assert packed["weight_absmax"].item() == 0.0
    assert packed["weight_packed"].eq(0x77).all()  # index 7 is the exact zero
    assert NF4Format().dequantize(packed).eq(0).all()
