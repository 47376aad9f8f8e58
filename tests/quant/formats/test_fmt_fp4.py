"""mxfp4 and nvfp4: plain-Python dequantization references, hand-checked scale rules, torchao as oracle."""

import warnings

import pytest
import torch

from orbit_lightning.quant.formats import MXFP4Format, NVFP4Format

SPEC_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _reference_codes(packed: torch.Tensor) -> list[list[float]]:
    """Byte j of a row holds element 2j in its low nibble and 2j+1 in its high nibble."""
    return [[SPEC_VALUES[c] for byte in row for c in (byte & 0xF, byte >> 4)] for row in packed.tolist()]


def _weight(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.02


def test_mxfp4_dequantize_matches_python_reference():
    fmt = MXFP4Format()
    packed = fmt.quantize(_weight((3, 64), 0))
    values, exps = _reference_codes(packed["weight_packed"]), packed["weight_scale"].tolist()
    expected = [[values[n][k] * 2.0 ** (exps[n][k // 32] - 127) for k in range(64)] for n in range(3)]
    assert fmt.dequantize(packed, torch.float64).tolist() == expected
    # a power-of-two scale times an e2m1 value is exact in bf16 too
    assert torch.equal(fmt.dequantize(packed), torch.tensor(expected).bfloat16())


def test_mxfp4_shared_exponent_rule():
    # block absmax 1.0 -> floor(log2) 0 -> exponent -2 -> 1.0 / 0.25 = 4 (code 6)
    # block absmax 0.75 -> exponent -3 -> 0.75 / 0.125 = 6 (code 7)
    # block absmax 7.9 -> exponent 0 -> 7.9 saturates to 6 (code 7)
    w = torch.zeros(3, 32)
    w[0, 0], w[1, 5], w[2, 31] = 1.0, 0.75, 7.9
    packed = MXFP4Format().quantize(w)
    assert packed["weight_scale"].flatten().tolist() == [125, 124, 127]
    deq = MXFP4Format().dequantize(packed, torch.float32)
    assert (deq[0, 0], deq[1, 5], deq[2, 31]) == (1.0, 0.75, 6.0)
    zero = MXFP4Format().quantize(torch.zeros(1, 32))
    assert zero["weight_scale"].item() == 0 and zero["weight_packed"].eq(0).all()


def test_nvfp4_dequantize_matches_python_reference():
    fmt = NVFP4Format()
    packed = fmt.quantize(_weight((3, 32), 1))
    values, scales = _reference_codes(packed["weight_packed"]), packed["weight_scale"].double().tolist()
    g = packed["weight_global_scale"].double().item()
    expected = [[values[n][k] * scales[n][k // 16] * g for k in range(32)] for n in range(3)]
    assert packed["weight_global_scale"].shape == ()  # one per matrix; leading dims only
    assert fmt.dequantize(packed, torch.float64).tolist() == expected  # all products exact in float64


def test_nvfp4_global_and_block_scale_rule():
    w = torch.zeros(2, 3, 16)
    w[0, 0, 0], w[0, 1, 3], w[1, 2, 7] = 2688.0, -6.0, 1.0  # per-expert absmax 2688 and 1
    packed = NVFP4Format().quantize(w)
    # global = absmax / (448 * 6); block scale = block_absmax / 6 / global, in e4m3
    assert packed["weight_global_scale"].tolist() == [1.0, torch.tensor(1.0 / 2688).item()]  # float32
    assert packed["weight_scale"][0, :2, 0].float().tolist() == [448.0, 1.0]
    assert packed["weight_scale"][1, 2, 0].float().item() == 448.0
    # blocks with nothing in them clamp to the smallest normal e4m3 scale, 2^-6
    assert packed["weight_scale"][0, 2, 0].float().item() == 2.0**-6
    torch.testing.assert_close(NVFP4Format().dequantize(packed, torch.float64), w.double(), rtol=1e-6, atol=0)


@pytest.fixture(scope="module")
def torchao_mx():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
        nv = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    return mx, nv


def test_mxfp4_matches_torchao_bit_for_bit(torchao_mx):
    mx, _ = torchao_mx
    w = _weight((64, 256), 2)
    w[5, :64] = 0  # all-zero blocks too
    for x in (w, w.bfloat16()):
        scale, data = mx.to_mx(x, torch.float4_e2m1fn_x2, 32)  # default FLOOR scale mode
        packed = MXFP4Format().quantize(x)
        assert torch.equal(scale.view(torch.uint8), packed["weight_scale"])
        assert torch.equal(data.view(torch.uint8), packed["weight_packed"])


def test_nvfp4_matches_torchao_bit_for_bit(torchao_mx):
    _, nv = torchao_mx
    w = _weight((64, 256), 3)
    global_scale = nv.per_tensor_amax_to_scale(w.abs().max())
    scale, data = nv.nvfp4_quantize(w, 16, global_scale)
    packed = NVFP4Format().quantize(w)
    assert packed["weight_global_scale"].item() == global_scale.item()
    assert torch.equal(scale.view(torch.uint8), packed["weight_scale"].view(torch.uint8))
    assert torch.equal(data.view(torch.uint8), packed["weight_packed"])
