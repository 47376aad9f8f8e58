"""int4 group quantization in the compressed-tensors pack-quantized layout."""

import pytest
import torch

from orbit_lightning.quant.formats import Int4Format, pack_int4, unpack_int4
from orbit_lightning.quant.formats.int4 import int4_codes


def _reference_unpack(words: torch.Tensor) -> list[list[int]]:
    """Plain-Python unpack: value j of each word sits in bits 4j..4j+3 as q + 8."""
    rows = []
    for row in words.tolist():
        out = []
        for word in row:
            unsigned = word & 0xFFFFFFFF
            out += [((unsigned >> (4 * j)) & 0xF) - 8 for j in range(8)]
        rows.append(out)
    return rows


def test_pack_matches_bit_layout():
    q = torch.tensor([[-8, -1, 0, 1, 2, 3, 7, -7, 7, 7, 7, 7, 7, 7, 7, 7]], dtype=torch.int8)
    packed = pack_int4(q)
    # word 0 nibbles (q + 8), lowest first: 0, 7, 8, 9, 10, 11, 15, 1 -> 0x1FBA9870
    # word 1: all 15 -> 0xFFFFFFFF, i.e. -1 as two's-complement int32
    assert packed.dtype == torch.int32
    assert packed.tolist() == [[0x1FBA9870, -1]]
    assert _reference_unpack(packed) == q.tolist()


def test_unpack_inverts_pack_for_all_codes():
    q = torch.randint(-8, 8, (3, 5, 64), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(unpack_int4(pack_int4(q)), q)


def test_scale_and_codes_follow_compressed_tensors():
    # absmax 7.5 -> scale exactly 1.0 (absmax / 7.5); round half to even, clamp to [-8, 7]
    row = torch.zeros(32)
    row[:6] = torch.tensor([7.5, -7.5, 2.5, 3.5, -0.5, 1.2])
    packed = Int4Format(32).quantize(row.view(1, 32))
    assert packed["weight_scale"].tolist() == [[1.0]]
    assert unpack_int4(packed["weight_packed"])[0, :6].tolist() == [7, -8, 2, 4, 0, 1]
    assert packed["weight_shape"].tolist() == [1, 32]


def test_dequantize_matches_python_reference():
    fmt = Int4Format(32)
    w = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)) * 0.02
    packed = fmt.quantize(w)
    codes = _reference_unpack(packed["weight_packed"])
    scales = packed["weight_scale"].double().tolist()
    expected = torch.tensor([[codes[n][k] * scales[n][k // 32] for k in range(64)] for n in range(3)])
    assert torch.equal(fmt.dequantize(packed, torch.float64), expected.double())  # q * bf16 scale is exact
    assert torch.equal(fmt.dequantize(packed), expected.bfloat16())  # one rounding to bf16


def test_requantizing_with_stored_scale_reproduces_codes():
    # The /7.5 scale itself is not a fixed point, but codes given the stored scale must round-trip exactly.
    fmt = Int4Format(64)
    w = torch.randn(2, 4, 128, generator=torch.Generator().manual_seed(2)) * 0.02
    packed = fmt.quantize(w)
    deq = fmt.dequantize(packed, torch.float32)
    assert torch.equal(pack_int4(int4_codes(deq, packed["weight_scale"])), packed["weight_packed"])


def test_zero_group_gets_a_nonzero_scale():
    packed = Int4Format(32).quantize(torch.zeros(2, 64))
    assert (packed["weight_scale"] > 0).all()
    assert torch.equal(Int4Format(32).dequantize(packed), torch.zeros(2, 64, dtype=torch.bfloat16))


def test_k_not_divisible_by_group_is_a_clear_error():
    with pytest.raises(ValueError, match="K = 96 .* not a multiple of the group size 64"):
        Int4Format(64).quantize(torch.randn(4, 96))
