"""Dense fused dequant-GEMM (forward and dX) under the Triton interpreter, against float64 oracles."""

import pytest
import torch

from orbit_lightning import kernels
from orbit_lightning.quant.formats import get_format
from tests.kernels.kernel_oracles import assert_within, matmul_bound, random_weight

pytestmark = pytest.mark.usefixtures("cpu_kernels")

# (N, K, K tile): every K is a legal size for its format but not a multiple of the K tile, and N is
# not a multiple of the other tile, so every masked edge is exercised (fp8's N also spans two
# 128-row scale blocks).
SHAPES = {
    "int4": (40, 160, 64),
    "int4-g64": (24, 192, 128),
    "int4-g128": (24, 384, 256),
    # int4-tiled: whole blocks of 16 rows x 128 (N = 48 is a partial 32-row tile); K tiles inside a block or over two
    "int4-tiled": (48, 512, 256),
    "int4-g64-tiled": (32, 512, 64),
    "fp8": (150, 200, 64),
    "mxfp4": (33, 96, 64),
    "nvfp4": (20, 80, 32),
}


def _config(variant: str, k_tile: int, dx: bool) -> kernels.TileConfig:
    """A config whose K extent is k_tile: block_r for the forward pass, block_p for dX."""
    other = 16 if variant == "split" else 32  # small reduction tiles so the split has >1 piece
    bp, br = (k_tile, other) if dx else (other, k_tile)
    return kernels.TileConfig(16, bp, br, swap_ab=variant != "plain", split_k=3 if variant == "split" else 1)


def _fp32_rel(k: int) -> float:
    # Dequantized values are exact or rounded once in fp32, and fp32 accumulation of k terms
    # adds at most k roundings: gamma_k ~ (k + 2) * 2^-24 relative to sum |x||w|.
    return (k + 2) * 2.0**-24


@pytest.mark.parametrize("variant", ["plain", "swap", "split"])
@pytest.mark.parametrize("fmt", list(SHAPES))
def test_forward_matches_fp64(fmt, variant):
    n, k, k_tile = SHAPES[fmt]
    packed, w = random_weight(fmt, (n, k), seed=1)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(2))
    y = kernels.dequant_linear(x, fmt, packed, config=_config(variant, k_tile, dx=False))
    ref = x.double() @ w.T
    assert y.shape == (5, n) and y.dtype == torch.float32
    assert_within(y, ref, matmul_bound(x, w, ref, _fp32_rel(k)))


@pytest.mark.parametrize("variant", ["plain", "swap", "split"])
@pytest.mark.parametrize("fmt", list(SHAPES))
def test_dx_matches_fp64(fmt, variant):
    n, k, k_tile = SHAPES[fmt]
    packed, w = random_weight(fmt, (n, k), seed=3)
    dy = torch.randn(5, n, generator=torch.Generator().manual_seed(4))
    dx = kernels.dequant_linear_dx(dy, fmt, packed, config=_config(variant, k_tile, dx=True))
    ref = dy.double() @ w
    assert dx.shape == (5, k) and dx.dtype == torch.float32
    assert_within(dx, ref, matmul_bound(dy, w.T, ref, _fp32_rel(n)))


def test_int4_entry_points_default_config_and_shapes():
    packed, w = random_weight("int4", (24, 64), seed=5)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 3, 64, generator=gen)  # leading dims are kept
    y = kernels.int4_linear(x, packed, group_size=32)
    ref = x.double() @ w.T
    assert y.shape == (2, 3, 24)
    assert_within(y, ref, matmul_bound(x, w, ref, _fp32_rel(64)))

    one = kernels.int4_linear(x[0, :1], packed)  # a single token
    assert_within(one, ref[0, :1], matmul_bound(x[0, :1], w, ref[0, :1], _fp32_rel(64)))

    dy = torch.randn(1, 24, generator=gen)
    dx = kernels.int4_linear_dx(dy, packed, 32)
    ref_dx = dy.double() @ w
    assert_within(dx, ref_dx, matmul_bound(dy, w.T, ref_dx, _fp32_rel(24)))

    assert kernels.int4_linear(x[:0, 0], packed).shape == (0, 24)  # no tokens: no launch, right shape


def test_fp16_activations_and_quantformat_object():
    fmt = get_format("int4-g128")
    packed, w = random_weight("int4-g128", (32, 256), seed=7)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(8)).half()
    y = kernels.dequant_linear(x, fmt, packed)  # a QuantFormat object is accepted like its name
    ref = x.double() @ w.T
    assert y.dtype == torch.float16
    # fp16: each weight rounds once (2^-11) when cast for the dot, the output rounds once (2^-11).
    assert_within(y, ref, matmul_bound(x, w, ref, 2.0**-10))
    dy = torch.randn(4, 32, generator=torch.Generator().manual_seed(9)).half()
    dx = kernels.dequant_linear_dx(dy, fmt, packed)
    ref_dx = dy.double() @ w
    assert_within(dx, ref_dx, matmul_bound(dy, w.T, ref_dx, 2.0**-10))
