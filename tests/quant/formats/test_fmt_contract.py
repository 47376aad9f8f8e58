"""The QuantFormat contract, checked for every registered format."""

import pytest
import torch

from orbit_lightning.quant.formats import FORMATS, get_format, index_leading, quantization_error

ALL = sorted(FORMATS)
SHAPE = (3, 64, 1024)  # [E, N, K]: K divisible by every block size (and int4-tiled's), N not a multiple of fp8's 128


def _weight(shape=SHAPE, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.02


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _assert_same_bits(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(_bits(a[k]), _bits(b[k])), k


@pytest.mark.parametrize("spec", ALL)
@pytest.mark.parametrize("shape", [SHAPE, (64, 1024)])
def test_packed_shapes_match_quantize(spec, shape):
    fmt = get_format(spec)
    packed = fmt.quantize(_weight(shape).bfloat16())
    meta = fmt.empty_packed(shape)
    assert meta.keys() == packed.keys()
    for k, t in packed.items():
        assert meta[k].is_meta and meta[k].shape == t.shape and meta[k].dtype == t.dtype, k
        assert t.is_contiguous(), k
        assert t.shape[: len(shape) - 2] == shape[:-2], f"{k} must keep the leading dims"
    assert fmt.nbytes(shape) == sum(t.numel() * t.element_size() for t in packed.values())
    assert fmt.dequantize(packed).shape == shape and fmt.dequantize(packed).dtype == torch.bfloat16


@pytest.mark.parametrize("spec", ALL)
def test_leading_dim_indexing_and_expert_independence(spec):
    fmt = get_format(spec)
    w = _weight()
    packed = fmt.quantize(w)
    full = fmt.dequantize(packed, torch.float32)
    for idx in (1, torch.tensor([2, 0]), slice(1, 3)):
        assert torch.equal(fmt.dequantize(index_leading(packed, idx), torch.float32), full[idx])
    # every scale is per matrix or finer, so stacking experts changes nothing
    _assert_same_bits(index_leading(packed, 2), fmt.quantize(w[2]))


# Relative Frobenius error on N(0, 0.02) weights. Measured 0.095 / 0.103 / 0.111 (int4 g32/64/128), 0.0265
# (fp8), 0.114 (mxfp4), 0.095 (nvfp4), 0.092 (nf4), varying < 1% across seeds. Why those values:
# - int4: step = absmax / 7.5 and rounding error rms = step / sqrt(12); the absmax of g normals is about
#   2.4 / 2.6 / 2.8 sigma for g = 32 / 64 / 128, giving 0.092 / 0.100 / 0.108.
# - fp8 e4m3: 3 mantissa bits, relative rounding error up to 2^-4, rms about 2^-4 / sqrt(3) / 1.4 ~ 0.026.
# - fp4 formats: 1 mantissa bit; mxfp4's power-of-two scale leaves blocks up to 2x under-scaled, so it is
#   worse than nvfp4 (e4m3 scale over 16 elements); nf4 spends its 16 levels on normal quantiles.
# Bounds are about +-15% around the measurement: loose against seed/shape noise, tight enough to catch a
# wrong scale rule or a lost bit (which moves the error by 2x).
ERROR_RANGE = {
    "int4": (0.08, 0.11),
    "int4-g64": (0.088, 0.12),
    "int4-g128": (0.095, 0.13),
    "fp8": (0.022, 0.031),
    "mxfp4": (0.097, 0.132),
    "nvfp4": (0.08, 0.11),
    "nf4": (0.078, 0.106),
}
ERROR_RANGE |= {f"{name}-tiled": ERROR_RANGE[name] for name in ("int4", "int4-g64", "int4-g128")}  # the same values


def test_error_bounds_cover_every_format():
    assert set(ERROR_RANGE) == set(ALL)


@pytest.mark.parametrize("spec", ALL)
def test_relative_error_in_expected_range(spec):
    lo, hi = ERROR_RANGE[spec]
    err = quantization_error(_weight((128, 1024), seed=1).bfloat16(), spec)
    assert lo < err["rel_fro"] < hi


def test_error_ordering():
    w = _weight((128, 512), seed=2)
    specs = ("int4", "int4-g64", "int4-g128", "mxfp4", "nvfp4")
    err = {s: quantization_error(w, s)["rel_fro"] for s in specs}
    assert err["int4"] < err["int4-g64"] < err["int4-g128"]  # bigger groups, coarser steps
    assert err["nvfp4"] < err["mxfp4"]


# int4 is absent: its absmax / 7.5 scale is not a fixed point (see test_fmt_int4 for its code round trip).
@pytest.mark.parametrize("spec", ["fp8", "mxfp4", "nvfp4", "nf4"])
def test_requantizing_dequantized_weight_is_bit_exact(spec):
    fmt = get_format(spec)
    w = _weight()
    w[0, :7] = 0.0  # all-zero blocks take the special-case scale
    packed = fmt.quantize(w)
    _assert_same_bits(fmt.quantize(fmt.dequantize(packed, torch.float64)), packed)
    if spec == "mxfp4":  # power-of-two scales: exact even through bf16
        _assert_same_bits(fmt.quantize(fmt.dequantize(packed, torch.bfloat16)), packed)


@pytest.mark.parametrize("spec", [s for s in ALL if s != "fp8"])
def test_k_not_divisible_by_block_is_a_clear_error(spec):
    fmt = get_format(spec)
    with pytest.raises(ValueError, match=r"K = 200 \(in features\) is not a multiple"):
        fmt.packed_shapes((4, 200))
    with pytest.raises(ValueError, match="not a multiple"):
        fmt.quantize(torch.randn(4, 200))


@pytest.mark.parametrize("spec", ALL)
def test_bad_inputs_are_clear_errors(spec):
    fmt = get_format(spec)
    with pytest.raises(ValueError, match=r"shape \[\.\.\., N, K\]"):
        fmt.validate((256,))
    with pytest.raises(TypeError, match="floating-point"):
        fmt.quantize(torch.ones(16, 1024, dtype=torch.int32))
    with pytest.raises(ValueError, match="NaN or inf"):
        fmt.quantize(torch.full((16, 1024), float("nan")))
    packed = fmt.quantize(_weight((16, 1024)))
    missing = next(iter(packed))
    with pytest.raises(KeyError, match=missing):
        fmt.dequantize({k: v for k, v in packed.items() if k != missing})


@pytest.mark.parametrize("spec", ALL)
def test_random_packed(spec):
    fmt = get_format(spec)
    # Each scale block draws a jitter u ~ U(0.75, 1.25) (std of u^2 ~ 0.29), so the weight variance has
    # relative noise 0.29 / sqrt(#blocks). fp8's 128 x 128 blocks need a bigger weight: 256 blocks -> 0.9%
    # noise on the std; the others have >= 4096 blocks and 262k elements (~0.3% noise).
    shape = (16, 256, 1024) if spec == "fp8" else (2, 128, 1024)
    packed = fmt.random_packed(shape, generator=torch.Generator().manual_seed(0))
    expected = {k: (torch.Size(s), dt) for k, (s, dt) in fmt.packed_shapes(shape).items()}
    assert {k: (v.shape, v.dtype) for k, v in packed.items()} == expected
    w = fmt.dequantize(packed, torch.float32)
    assert torch.isfinite(w).all()
    # 3% = over 3 sigma of that noise, plus the analytic E[scale^2] ignoring scale rounding to bf16 / e4m3.
    assert abs(w.std().item() / 0.02 - 1) < 0.03
    assert abs(w.mean().item()) < 0.0015  # nf4's codebook is slightly asymmetric: mean ~ 0.05 std
    again = fmt.random_packed(shape, generator=torch.Generator().manual_seed(0))
    _assert_same_bits(again, packed)
