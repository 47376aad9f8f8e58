"""GPU checks: bf16 kernels against float64 references, bit-exact batch invariance, CUDA-graph replay.

bf16 tolerance: the kernel rounds each dequantized weight once to bf16 (relative 2^-9), multiplies by
the bf16 activations exactly, accumulates in fp32 (K * 2^-24, far below 2^-9 here) and rounds the
output once (2^-9 of |y|). So |y - ref| <= 2^-9 (sum_k |x||w| + |ref|) holds rigorously; the tests
allow 2^-8 for margin.
"""

import importlib

import pytest
import torch

from orbit_lightning import kernels
from orbit_lightning.quant.formats import get_format
from tests.kernels.kernel_oracles import assert_within, matmul_bound, random_weight

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
BF16_REL = 2.0**-8
# (N, K): K = 1000 is not a multiple of any K tile (fp8 accepts any K); fp8's N spans 3 scale-row blocks.
SHAPES = {"int4": (384, 1024), "int4-g128": (256, 1024), "fp8": (300, 1000), "mxfp4": (256, 512),
          "nvfp4": (320, 768), "int4-tiled": (384, 1024), "int4-g128-tiled": (256, 1024)}
M_SIZES = (1, 16, 64, 300)  # decode with split-K, both small-M buckets, and a prefill-sized M


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator("cuda").manual_seed(seed), device="cuda")


def test_available():
    assert kernels.kernels_available("cuda")


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("fmt", list(SHAPES))
def test_dequantize_bf16_is_bit_exact(fmt, fast, monkeypatch):
    # Both sides round the exact fp32 product value * scale once to bf16; for int4 `fast` switches
    # between the packed-bf16 PTX decoder and the generic fp32 one.
    monkeypatch.setattr(kernels.configs, "FAST_INT4", fast)
    f = get_format(fmt)
    for shape in (SHAPES[fmt], (3, *SHAPES[fmt])):
        packed = f.random_packed(shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        assert torch.equal(kernels.dequantize(fmt, packed), f.dequantize(packed, torch.bfloat16))


@pytest.mark.parametrize("fmt", list(SHAPES))
def test_bf16_forward_and_dx_against_fp64(fmt):
    n, k = SHAPES[fmt]
    packed, w = random_weight(fmt, (n, k), seed=1, device="cuda")
    for m in M_SIZES:
        x = _randn(m, k, seed=m).bfloat16()
        ref = x.double() @ w.T
        assert_within(kernels.dequant_linear(x, fmt, packed), ref, matmul_bound(x, w, ref, BF16_REL))
        dy = _randn(m, n, seed=m + 1).bfloat16()
        ref_dx = dy.double() @ w
        dx = kernels.dequant_linear_dx(dy, fmt, packed)
        assert_within(dx, ref_dx, matmul_bound(dy, w.T, ref_dx, BF16_REL))


@pytest.mark.parametrize("m", [17, 64])
def test_bf16_long_k_decode_config_against_fp64(m, monkeypatch):
    """configs.LONG_K's forward config (int4 on bf16, 17-64 rows, K >= 12288: 256 of K per step) is the one
    dense_gemm launches where the warpgroup-MMA kernel does not serve (off here; it needs Hopper), and meets the
    same bound."""
    monkeypatch.setattr(kernels.configs, "WGMMA_INT4", False)
    n, k = 512, kernels.configs.LONG_K
    gemm = importlib.import_module("orbit_lightning.kernels.gemm")
    picked = []
    monkeypatch.setattr(gemm, "pick_config", lambda *a, _pick=gemm.pick_config: picked.append(_pick(*a)) or picked[-1])
    packed, w = random_weight("int4", (n, k), seed=3, device="cuda")
    x = _randn(m, k, seed=m).bfloat16()
    ref = x.double() @ w.T
    assert_within(kernels.dequant_linear(x, "int4", packed), ref, matmul_bound(x, w, ref, BF16_REL))
    assert picked == [kernels.configs._FWD_LONG_K]


@pytest.mark.parametrize("fmt", ["int4", "mxfp4", "nvfp4"])
def test_bf16_grouped_against_fp64(fmt):
    counts = [70, 0, 1, 130, 0, 45, 2, 52]  # empty experts, a single-token expert, multi-tile experts
    packed, w = random_weight(fmt, (len(counts), 256, 512), seed=2, device="cuda")
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], device="cuda")
    x = _randn(sum(counts), 512, seed=3).bfloat16()
    dy = _randn(sum(counts), 256, seed=4).bfloat16()
    y = kernels.grouped_dequant_linear(x, offsets, fmt, packed)
    dx = kernels.grouped_dequant_linear_dx(dy, offsets, fmt, packed)
    for e, (xs, dys, ys, dxs) in enumerate(zip(x.split(counts), dy.split(counts), y.split(counts),
                                               dx.split(counts))):
        ref = xs.double() @ w[e].T
        assert_within(ys, ref, matmul_bound(xs, w[e], ref, BF16_REL))
        ref_dx = dys.double() @ w[e]
        assert_within(dxs, ref_dx, matmul_bound(dys, w[e].T, ref_dx, BF16_REL))


@pytest.mark.parametrize("fmt", ["int4", "nvfp4", "fp8"])
def test_batch_invariant_rows_are_bit_identical(fmt):
    n, k = SHAPES[fmt]
    packed, _ = random_weight(fmt, (n, k), seed=5, device="cuda")
    x = _randn(300, k, seed=6).bfloat16()
    with kernels.batch_invariant():
        full = kernels.dequant_linear(x, fmt, packed)
        for m in (1, 5, 37, 64, 65):
            part = kernels.dequant_linear(x[-m:], fmt, packed)  # rows change position and batch size
            assert torch.equal(part, full[-m:]), f"M={m} differs from the same rows at M=300"
    fast_one = kernels.dequant_linear(x[:1], fmt, packed)  # fast mode may split K at M=1
    assert (fast_one.float() - full[:1].float()).abs().max() < 0.05 * full[:1].float().abs().max()


def test_batch_invariant_grouped_matches_dense_bitwise():
    packed, _ = random_weight("int4", (4, 384, 1024), seed=7, device="cuda")
    counts = [33, 0, 100, 7]
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], device="cuda")
    x = _randn(sum(counts), 1024, seed=8).bfloat16()
    with kernels.batch_invariant():
        y = kernels.grouped_dequant_linear(x, offsets, "int4", packed)
        shifted = kernels.grouped_dequant_linear(x[33:], offsets[1:] - 33, "int4",
                                                 {k: v[1:] for k, v in packed.items()})
        assert torch.equal(shifted, y[33:])  # other experts' tokens leave a row unchanged
        for e, (xs, ys) in enumerate(zip(x.split(counts), y.split(counts))):
            dense = kernels.dequant_linear(xs, "int4", {k: v[e] for k, v in packed.items()})
            assert torch.equal(dense, ys), f"expert {e}: grouped and dense rows differ"


def test_split_k_is_deterministic_and_graph_capturable():
    packed, w = random_weight("int4", (4096, 4096), seed=9, device="cuda")
    x = _randn(4, 4096, seed=10).bfloat16()
    first = kernels.int4_linear(x, packed)
    assert all(torch.equal(first, kernels.int4_linear(x, packed)) for _ in range(5))
    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = kernels.int4_linear(static_x, packed)
    for seed in (11, 12):  # replays with new inputs re-arm the split-K tickets correctly
        static_x.copy_(_randn(4, 4096, seed=seed).bfloat16())
        graph.replay()
        assert torch.equal(static_y, kernels.int4_linear(static_x, packed))


def test_rms_norm_rows_are_batch_invariant():
    x = _randn(257, 4096, seed=13).bfloat16()
    w = (1 + 0.1 * _randn(4096, seed=14)).bfloat16()
    full = kernels.rms_norm(x, w)
    assert torch.equal(kernels.rms_norm(x[100:101], w), full[100:101])
    ref = w.double() * (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    # fp32 vs fp64 statistics may flip the bf16 rounding of the normalized value (one ulp, <= 2^-7
    # relative), and the output rounds once more (2^-9).
    assert ((full.double() - ref).abs() <= 2.0**-6 * ref.abs() + 1e-6).all()
