"""Grouped MoE GEMM over active experts (forward and dX) under the interpreter, against float64 oracles."""

import pytest
import torch
import triton
import triton.language as tl

from orbit_lightning import kernels
from tests.kernels.kernel_oracles import assert_within, expert_offsets, matmul_bound, random_weight

pytestmark = pytest.mark.usefixtures("cpu_kernels")

# Expert 1 and 4 get no tokens, expert 3 a single one; expert 2 spans more than one 16-row tile.
COUNTS = [3, 0, 19, 1, 0]
# (N, K); fp8: two scale-row blocks; int4-tiled: whole blocks of 16 rows x 128
SHAPES = {"int4": (40, 96), "fp8": (130, 72), "nvfp4": (24, 48), "int4-tiled": (48, 256)}


def _per_expert(a: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """float64 oracle: rows of expert e times w[e] ([E, P, R] already oriented)."""
    chunks = a.double().split(counts)
    return torch.cat([c @ w[e].T for e, c in enumerate(chunks)])


@triton.jit
def _find_tiles(offsets_ptr, out_ptr, num_experts, BM: tl.constexpr, E_POW2: tl.constexpr):
    t = tl.program_id(0)
    expert, first, end = kernels.grouped._find_tile(offsets_ptr, t, num_experts, BM, E_POW2)
    tl.store(out_ptr + 3 * t, expert)
    tl.store(out_ptr + 3 * t + 1, first)
    tl.store(out_ptr + 3 * t + 2, end)


@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64])
def test_each_program_finds_its_tile_among_active_experts_only(offsets_dtype):
    out = torch.zeros(8, 3, dtype=torch.int64)
    _find_tiles[(8,)](expert_offsets(COUNTS).to(offsets_dtype), out, len(COUNTS), BM=16, E_POW2=8)
    # expert 0: rows 0..2 (1 tile); expert 2: rows 3..21 (2 tiles); expert 3: row 22; then past the last tile.
    assert out[:4].tolist() == [[0, 0, 3], [2, 3, 22], [2, 19, 22], [3, 22, 23]]
    assert (out[4:, 0] >= len(COUNTS)).all()
    one = torch.zeros(3, 3, dtype=torch.int64)  # a single expert (E_POW2 = 1)
    _find_tiles[(3,)](expert_offsets([20]).to(offsets_dtype), one, 1, BM=16, E_POW2=1)
    assert one[:2].tolist() == [[0, 0, 20], [0, 16, 20]] and one[2, 0] >= 1


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("fmt", list(SHAPES))
def test_grouped_forward_and_dx(fmt, swap):
    n, k = SHAPES[fmt]
    packed, w = random_weight(fmt, (len(COUNTS), n, k), seed=11)
    gen = torch.Generator().manual_seed(12)
    offsets = expert_offsets(COUNTS)
    t = sum(COUNTS)
    cfg = kernels.TileConfig(16, 32, 32, swap_ab=swap)

    x = torch.randn(t, k, generator=gen)
    y = kernels.grouped_dequant_linear(x, offsets, fmt, packed, config=cfg)
    ref = _per_expert(x, w, COUNTS)
    bound = torch.cat([matmul_bound(c, w[e], r, (k + 2) * 2.0**-24)
                       for e, (c, r) in enumerate(zip(x.split(COUNTS), ref.split(COUNTS)))])
    assert y.shape == (t, n)
    assert_within(y, ref, bound)

    dy = torch.randn(t, n, generator=gen)
    dx = kernels.grouped_dequant_linear_dx(dy, offsets, fmt, packed, config=cfg)
    wt = w.transpose(1, 2)
    ref_dx = _per_expert(dy, wt, COUNTS)
    bound_dx = torch.cat([matmul_bound(c, wt[e], r, (n + 2) * 2.0**-24)
                          for e, (c, r) in enumerate(zip(dy.split(COUNTS), ref_dx.split(COUNTS)))])
    assert dx.shape == (t, k)
    assert_within(dx, ref_dx, bound_dx)


def test_grouped_single_token_and_fp16():
    packed, w = random_weight("int4", (3, 32, 64), seed=13)
    offsets = torch.tensor([0, 0, 1, 1], dtype=torch.int64)  # the one token goes to expert 1
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(14)).half()
    y = kernels.grouped_dequant_linear(x, offsets, "int4", packed)
    ref = x.double() @ w[1].T
    assert y.dtype == torch.float16
    assert_within(y, ref, matmul_bound(x, w[1], ref, 2.0**-10))  # fp16 weight cast + output rounding
    no_tokens = torch.zeros(4, dtype=torch.int32)
    assert kernels.grouped_dequant_linear(x[:0], no_tokens, "int4", packed).shape == (0, 32)
