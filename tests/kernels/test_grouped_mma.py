"""MoE decode on the mma kernel (kernels/grouped_mma.py): which weights and batches it takes, its results against the
float64 oracle (on the CPU with its PTX emulated per lane, kernels/emulate.py; on the GPU), bitwise determinism, graph
replay and the dispatch.

tests/kernels/test_compile_sm90.py compiles its PTX on the CPU. GPU bound: test_gemv.py's
2^-8 (sum |x||w| + |ref|), as for gemv_mma.py, whose loop this is: each weight rounds once to bf16 by the same
decoder, products are exact in the mma, the fp32 sum adds K 2^-24 and the output rounds once.
"""

from dataclasses import replace

import pytest
import torch
from orbit_lightning.kernels import configs
from orbit_lightning.kernels.formats import resolve
from orbit_lightning.kernels.grouped_mma import grouped_mma

from orbit_lightning import kernels
from tests.kernels.kernel_oracles import assert_within, expert_offsets, gpu, matmul_bound, random_weight


def test_the_grouped_mma_kernel_reads_only_stacked_int4_in_whole_steps():
    cfg = configs._GROUPED_MMA
    for fmt, shape, ok in [("int4", (4, 64, 256), True), ("int4-g128", (4, 64, 512), True),
                           ("int4", (4, 64, 384), False),  # 3 K tiles: not whole steps of 2
                           ("int4", (4, 48, 256), False), ("fp8", (4, 64, 256), False),
                           ("int4", (64, 256), False)]:  # fmt: skip
        packed, _ = random_weight(fmt, shape, seed=0)
        stacked = len(shape) == 3
        assert configs.mma_ok(resolve(fmt, packed, stacked=stacked), cfg, stacked=True) == ok, (fmt, shape)
    packed, _ = random_weight("int4", (4, 48, 384), seed=0)
    assert configs.mma_ok(resolve("int4", packed, stacked=True), configs._GROUPED_MMA_NARROW[1], stacked=True)


def _check(x, w, counts, y, rel=2.0**-8):
    ref = torch.cat([c.double() @ w[e].T for e, c in enumerate(x.split(counts))])
    bound = torch.cat([matmul_bound(c, w[e], r, rel) for e, (c, r) in
                       enumerate(zip(x.split(counts), ref.split(counts)))])  # fmt: skip
    assert_within(y, ref, bound)


# Expert 0 gets 20 rows (three 8-row tiles, the last partial), 1-2 none, 3 one; the rest spread.
ROUTINGS = {
    "batch1-top8": [1 if e % 4 == 1 else 0 for e in range(32)],
    "mixed": [20, 0, 0, 1, 3, 8, 9, 0],
    "one-expert": [5, 0, 0, 0],
}
CASES = {  # name: (format, E, N, K, config)
    "two-row-tiles": ("int4", 8, 256, 2048, configs._GROUPED_MMA),
    "one-row-tile": ("int4", 8, 96, 768, configs._GROUPED_MMA_NARROW[0]),
    "one-k-tile-steps-g128": ("int4-g128", 8, 64, 384, configs._GROUPED_MMA_NARROW[1]),
    "one-warp": ("int4", 8, 32, 256, replace(configs._GROUPED_MMA, num_warps=1)),
    "tiled-two-row-tiles": ("int4-tiled", 8, 256, 2048, configs._GROUPED_MMA),
    "tiled-one-k-tile-steps-g128": ("int4-g128-tiled", 8, 64, 2048, configs._GROUPED_MMA_NARROW[1]),
}


def _against_fp64(case, routing, device, rel):
    fmt, e, n, k, cfg = {**CASES, **CPU_CASES}[case]
    counts = (ROUTINGS[routing] + [0] * e)[:e]
    counts[-1] += sum(ROUTINGS[routing][e:])  # (routings wider than E pile their rest on the last expert)
    packed, w = random_weight(fmt, (e, n, k), seed=3, device=device)
    wk = resolve(fmt, packed, stacked=True)
    assert configs.mma_ok(wk, cfg, stacked=True)
    x = torch.randn(sum(counts), k, generator=torch.Generator().manual_seed(4)).to(device, torch.bfloat16)
    for dtype in (torch.int32, torch.int64):
        offsets = expert_offsets(counts, dtype, device)
        y = grouped_mma(x, offsets, wk, cfg)
        _check(x, w, counts, y, rel)
        assert torch.equal(y, grouped_mma(x, offsets, wk, cfg))


CPU_CASES = {  # small shapes: the emulation multiplies every lane's tile out in numpy
    "cpu-two-row-tiles": ("int4", 8, 32, 256, configs._GROUPED_MMA),
    "cpu-one-k-tile-steps-g128": ("int4-g128", 8, 16, 384, configs._GROUPED_MMA_NARROW[1]),
    "cpu-tiled-two-row-tiles": ("int4-tiled", 4, 32, 256, configs._GROUPED_MMA),  # experts of 2 row blocks
    # one warp's 8 one-tile steps: 16 scale groups, two block rows, found group by group
    "cpu-tiled-one-k-tile-steps-g64": ("int4-g64-tiled", 4, 16, 1024, replace(configs._GROUPED_MMA_NARROW[1],
                                                                              num_warps=1)),
}


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("routing", ["mixed", "one-expert"])
@pytest.mark.parametrize("case", list(CPU_CASES))
def test_grouped_mma_under_the_interpreter(case, routing):
    """The kernel with its PTX emulated per lane (kernels/emulate.py): expert tiles, row masks, warp splits. Bound
    2^-7: the interpreter's bf16 output cast truncates (one ulp, not half)."""
    _against_fp64(case, routing, "cpu", 2.0**-7)


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("fmt", ["int4", "int4-tiled"])
def test_swiglu_under_the_interpreter_is_the_projections_and_silu_mul(fmt):
    e, n, k = 4, 32, 256
    gate, _ = random_weight(fmt, (e, n, k), seed=5)
    up, _ = random_weight(fmt, (e, n, k), seed=6)
    wg, wu = resolve(fmt, gate, stacked=True), resolve(fmt, up, stacked=True)
    cfg = configs._GROUPED_MMA_NARROW[0]
    counts = [9, 0, 1, 3]
    x = torch.randn(sum(counts), k, generator=torch.Generator().manual_seed(7)).bfloat16()
    offsets = expert_offsets(counts)
    h = grouped_mma(x, offsets, wg, cfg, up=wu)
    assert torch.equal(h, kernels.silu_mul(grouped_mma(x, offsets, wg, cfg), grouped_mma(x, offsets, wu, cfg)))


@gpu
@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_grouped_mma_matches_fp64_deterministically(case, routing):
    _against_fp64(case, routing, "cuda", 2.0**-8)


@gpu
def test_gpu_decode_batches_take_the_mma_kernel_and_replay_in_a_graph():
    """grouped_dequant_linear sends a few rows per expert to grouped_mma (bitwise its result), more rows, a given
    config or batch-invariant mode to the tile kernel; a captured decode step replays with new rows and routing."""
    e, n, k = 16, 128, 1024
    packed, w = random_weight("int4", (e, n, k), seed=4, device="cuda")
    wk = resolve("int4", packed, stacked=True)
    counts = [2, 0, 1, 0, 3, 0, 0, 2] * 2
    x = torch.randn(sum(counts), k, device="cuda", dtype=torch.bfloat16)
    offsets = expert_offsets(counts, device="cuda")
    cfg = configs.pick_grouped_mma(x, wk)
    assert cfg is not None
    y = kernels.grouped_dequant_linear(x, offsets, "int4", packed)
    assert torch.equal(y, grouped_mma(x, offsets, wk, cfg))
    _check(x, w, counts, y)
    many = torch.randn(configs.GROUPED_MMA_ROWS * e + 1, k, device="cuda", dtype=torch.bfloat16)
    assert configs.pick_grouped_mma(many, wk) is None
    assert configs.pick_grouped_mma(torch.randn(8, k + 1, device="cuda", dtype=torch.bfloat16)[:, 1:], wk) is None
    with kernels.batch_invariant():
        assert configs.pick_grouped_mma(x, wk) is None

    static_x, static_offsets = x.clone(), offsets.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = kernels.grouped_dequant_linear(static_x, static_offsets, "int4", packed)
    for seed in (1, 2):
        gen = torch.Generator("cuda").manual_seed(seed)
        static_x.copy_(torch.randn(x.shape, generator=gen, device="cuda").bfloat16())
        moved = counts[seed:] + counts[:seed]  # the same rows routed to other experts
        static_offsets.copy_(expert_offsets(moved, device="cuda"))
        graph.replay()
        _check(static_x, w, moved, static_y)


@gpu
@pytest.mark.parametrize("cfg", [0, 1])
@pytest.mark.parametrize("fmt", ["int4", "int4-tiled"])
def test_gpu_swiglu_in_one_launch_is_bitwise_the_projections_and_silu_mul(cfg, fmt):
    cfg = configs._GROUPED_MMA_NARROW[cfg]
    e, n, k = 8, 96, 768
    gate, _ = random_weight(fmt, (e, n, k), seed=5, device="cuda")
    up, _ = random_weight(fmt, (e, n, k), seed=6, device="cuda")
    wg, wu = resolve(fmt, gate, stacked=True), resolve(fmt, up, stacked=True)
    for counts in (ROUTINGS["mixed"], [1, 0, 0, 0, 0, 0, 0, 0]):
        x = torch.randn(sum(counts), k, device="cuda", dtype=torch.bfloat16)
        offsets = expert_offsets(counts, device="cuda")
        h = grouped_mma(x, offsets, wg, cfg, up=wu)
        assert torch.equal(h, kernels.silu_mul(grouped_mma(x, offsets, wg, cfg), grouped_mma(x, offsets, wu, cfg)))


@gpu
def test_gpu_quant_experts_take_the_fused_swiglu_at_decode_only():
    """QuantExperts.swiglu: no autograd graph and a decode batch -> one launch (grouped_dequant_swiglu returns it);
    with a graph, or many rows, or batch-invariant mode -> the projections and silu_mul. The results agree within
    the fp32 summation order of other warp splits (bf16 rounding of the projections, then of the product)."""
    from orbit_lightning.quant.experts import QuantExperts
    from orbit_lightning.quant.grouped import ExpertGroups

    experts = QuantExperts(16, 512, 128, "int4").cuda()
    experts.random_init(torch.Generator("cuda").manual_seed(0))
    gate, up = experts.packed("gate_proj"), experts.packed("up_proj")
    counts = [2, 0, 1, 0, 3, 0, 0, 2] * 2
    x = torch.randn(sum(counts), 512, device="cuda", dtype=torch.bfloat16)
    offsets = expert_offsets(counts, device="cuda")
    fused = kernels.grouped_dequant_swiglu(x, offsets, "int4", gate, up)
    assert fused is not None
    with torch.no_grad():
        assert torch.equal(experts.swiglu(x, ExpertGroups(offsets)), fused)
    xg = x.clone().requires_grad_()
    unfused = experts.swiglu(xg, ExpertGroups(offsets))
    assert unfused.grad_fn is not None  # the projections' autograd path, not the kernel (which has no backward)
    torch.testing.assert_close(unfused.detach(), fused, rtol=2**-6, atol=1e-3)
    fewer = {name: t[:8] for name, t in up.items()}  # an up projection of another shape is not read
    three = expert_offsets([3] + [0] * 15, device="cuda")
    assert kernels.grouped_dequant_swiglu(x[:3], three, "int4", gate, fewer) is None
    many = torch.randn(configs.GROUPED_MMA_ROWS * 16 + 1, 512, device="cuda", dtype=torch.bfloat16)
    all_in_one = expert_offsets([many.shape[0]] + [0] * 15, device="cuda")
    assert kernels.grouped_dequant_swiglu(many, all_in_one, "int4", gate, up) is None
    with kernels.batch_invariant():
        assert kernels.grouped_dequant_swiglu(x, offsets, "int4", gate, up) is None
