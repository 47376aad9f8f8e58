"""Small-M (decode) forward kernel, gemv.py: interpreter tests against float64 oracles on the CPU, and
bf16 / determinism / dispatch checks on the GPU.

CPU bound: the kernel multiplies the dequantized weight (exact, or rounded once in fp32) by the
activations and accumulates in fp32 in some order, so |y - ref| <= (K + 2) 2^-24 (sum_k |x||w| + |ref|)
(fp16 activations add one fp16 rounding of each weight and of the output, 2^-11 each). GPU bf16 bound:
as in test_gpu.py, each weight rounds once to bf16 (2^-9), products are exact, the fp32 sum adds
K * 2^-24 (< 2^-12 here) and the output rounds once (2^-9): 2^-8 (sum |x||w| + |ref|) holds with margin.
"""

from dataclasses import replace

import pytest
import torch
import triton
import triton.language as tl
from orbit_lightning.kernels import configs, gemm, gemv
from orbit_lightning.kernels.configs import GemvConfig
from orbit_lightning.kernels.formats import resolve

from orbit_lightning import kernels
from tests.kernels.kernel_oracles import assert_within, gpu, matmul_bound, random_weight

# (N, K): odd N (a partial last row tile; fp8's spans two 128-row scale blocks) and K not a multiple of
# the 64-wide K tile used below (int4-g128: K = 384 is 6 tiles of 64 but 3 groups: tiles inside a group).
SHAPES = {
    "int4": (41, 160),
    "int4-g128": (23, 384),
    "int4-tiled": (48, 512),  # whole blocks; a partial 32-row tile
    "int4-g128-tiled": (32, 1024),
    "fp8": (150, 200),
    "mxfp4": (33, 96),
    "nvfp4": (19, 80),
}
CPU_CONFIGS = {
    "dot": GemvConfig(16, 16, 64, k_iters=0),  # one split over all of K
    "dot-split": GemvConfig(16, 32, 32, k_iters=1),  # one 32-wide K tile per program: several splits
    "dot-two": GemvConfig(16, 16, 32, k_iters=1, two_tiles=True),  # 2 tiles per step, the 2nd past K at the end
    "dot-two-noprefetch": GemvConfig(16, 32, 32, k_iters=2, two_tiles=True, prefetch=False),
    "fma": GemvConfig(4, 16, 64, k_iters=0, dot=False),
    "fma-split": GemvConfig(2, 16, 32, k_iters=2, dot=False),
}


def _fp32_rel(k: int) -> float:
    return (k + 2) * 2.0**-24


def _run(x, fmt, packed, cfg):
    w = resolve(fmt, packed, stacked=False)
    out = torch.empty((x.shape[0], w.n), dtype=x.dtype, device=x.device)
    return gemv.gemv(x, w, out, cfg, lambda n: gemm._tickets(x.device, n), fast_int4=False)


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("variant", list(CPU_CONFIGS))
@pytest.mark.parametrize("fmt", list(SHAPES))
def test_gemv_matches_fp64(fmt, variant):
    n, k = SHAPES[fmt]
    packed, w = random_weight(fmt, (n, k), seed=1)
    for m in (1, 3, 16):  # one row, a partial M tile, a full one (two M tiles for the fma configs)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        y = _run(x, fmt, packed, CPU_CONFIGS[variant])
        ref = x.double() @ w.T
        assert y.shape == (m, n) and y.dtype == torch.float32
        assert_within(y, ref, matmul_bound(x, w, ref, _fp32_rel(k)))


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("variant", ["dot-split", "fma"])
def test_gemv_fp16_and_strided_rows(variant):
    packed, w = random_weight("int4", (40, 128), seed=2)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(3)).half()[:, :128]  # row stride 256
    y = _run(x, "int4", packed, CPU_CONFIGS[variant])
    ref = x.double() @ w.T
    assert y.dtype == torch.float16
    assert_within(y, ref, matmul_bound(x, w, ref, 2.0**-10))


@pytest.mark.usefixtures("cpu_kernels")
def test_dense_gemm_routes_small_m_to_gemv_outside_invariant_mode(monkeypatch):
    packed, w = random_weight("int4", (24, 64), seed=4)
    calls = []
    real = gemv.gemv
    monkeypatch.setattr(gemm, "gemv", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(5))
    y = kernels.int4_linear(x, packed)  # leading dims flatten to M = 6
    assert calls == [6] and y.shape == (2, 3, 24)
    ref = x.double() @ w.T
    assert_within(y, ref, matmul_bound(x, w, ref, _fp32_rel(64)))
    kernels.int4_linear(torch.randn(17, 64), packed)  # above the decode bucket: the tile GEMM
    kernels.int4_linear(x[0], packed, config=kernels.TileConfig(16, 32, 32))  # an explicit tile config
    kernels.int4_linear_dx(torch.randn(1, 24), packed)  # dX keeps the tile kernel
    with kernels.batch_invariant():
        kernels.int4_linear(x[0, :1], packed)  # invariant mode: the one fixed tile config
    assert calls == [6]


# The descriptor (TMA) variant reads int4 only; its boxes need 16-byte rows of words and of scales.
TMA_CASES = {  # name: (fmt, N, K, config)
    "g32-split": ("int4", 41, 768, GemvConfig(16, 16, 256, k_iters=1, tma=True, num_stages=2)),
    "g32-one-split": ("int4", 20, 512, GemvConfig(16, 32, 256, k_iters=0, tma=True, num_stages=3)),
    "g128": ("int4-g128", 23, 2048, GemvConfig(16, 16, 1024, k_iters=1, tma=True, num_stages=2)),
}


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("case", list(TMA_CASES))
def test_gemv_tma_matches_fp64_and_the_pointer_kernel(case):
    fmt, n, k, cfg = TMA_CASES[case]
    packed, w = random_weight(fmt, (n, k), seed=6)
    assert gemv.tma_ok(resolve(fmt, packed, stacked=False), cfg)
    for m in (1, 3, 16):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        for dtype, rel in ((torch.float32, _fp32_rel(k)), (torch.float16, 2.0**-10)):
            y = _run(x.to(dtype), fmt, packed, cfg)
            ref = x.to(dtype).double() @ w.T
            assert_within(y, ref, matmul_bound(x.to(dtype), w, ref, rel))
            # same decoded values, same dot order per tile, same split sums: the same bits
            assert torch.equal(y, _run(x.to(dtype), fmt, packed, replace(cfg, tma=False)))


@pytest.mark.usefixtures("cpu_kernels")
def test_gemv_tma_falls_back_where_boxes_do_not_fit():
    cfg = GemvConfig(16, 16, 256, k_iters=1, tma=True)
    packed, w = random_weight("int4", (24, 160), seed=7)  # 5 scale groups per row: 10-byte scale rows
    assert not gemv.tma_ok(resolve("int4", packed, stacked=False), cfg)
    x = torch.randn(2, 160, generator=torch.Generator().manual_seed(8))
    ref = x.double() @ w.T
    assert_within(_run(x, "int4", packed, cfg), ref, matmul_bound(x, w, ref, _fp32_rel(160)))
    assert not gemv.tma_ok(resolve("fp8", random_weight("fp8", (24, 512), seed=7)[0], stacked=False), cfg)


@triton.jit
def _permute_probe(t_ptr, a_ptr, b_ptr, R: tl.constexpr, BK: tl.constexpr):
    rows = tl.arange(0, R)
    t = tl.load(t_ptr + rows[:, None] * BK + tl.arange(0, BK)[None, :])
    tl.store(a_ptr + rows[:, None] * BK + tl.arange(0, BK)[None, :], gemv._k_permute(t, R, BK))
    # nibble planes: o_j[r, c] = t[r, 8c + j], what the packed decoder returns for word c
    planes = tl.reshape(t, (R, BK // 8, 2, 2, 2))  # [r, c, j2, j1, j0], j = 4 j2 + 2 j1 + j0
    h0, h1 = tl.split(planes)  # j0
    o0, o4 = tl.split(tl.split(h0)[0])
    o2, o6 = tl.split(tl.split(h0)[1])
    o1, o5 = tl.split(tl.split(h1)[0])
    o3, o7 = tl.split(tl.split(h1)[1])
    p = gemv._k_permute_nibbles(o0, o1, o2, o3, o4, o5, o6, o7, R, BK)
    tl.store(b_ptr + rows[:, None] * BK + tl.arange(0, BK)[None, :], p)


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("bk", [32, 128, 256])
def test_nibble_plane_permutation_matches_tile_permutation(bk):
    # The GPU int4 path permutes K from the decoder's nibble planes, every other path from the natural
    # tile; weights and activations must land in the same (permuted) K order, and the order must be a
    # permutation.
    t = torch.arange(4 * bk, dtype=torch.float32).reshape(4, bk)
    a, b = torch.empty_like(t), torch.empty_like(t)
    _permute_probe[(1,)](t, a, b, R=4, BK=bk)
    assert torch.equal(a, b)
    assert torch.equal(a.sort(dim=1).values, t)


# ---------------------------------------------------------------------------------------------- GPU
GPU_SHAPES = {"int4": (384, 1024), "int4-g128": (256, 1024), "fp8": (300, 1000), "mxfp4": (256, 512),
              "nvfp4": (320, 768), "int4-tiled": (384, 1024)}  # fmt: skip


def _cuda_tickets(n: int) -> torch.Tensor:
    return gemm._tickets(torch.device("cuda", torch.cuda.current_device()), n)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator("cuda").manual_seed(seed), device="cuda")


@gpu
@pytest.mark.parametrize("fmt", list(GPU_SHAPES))
@pytest.mark.parametrize("dot", [True, False])
def test_gpu_bf16_against_fp64(fmt, dot):
    n, k = GPU_SHAPES[fmt]
    packed, w = random_weight(fmt, (n, k), seed=1, device="cuda")
    cfg = GemvConfig(16, 32, 128, k_iters=2, dot=dot, num_warps=1 if dot else 4)
    wk = resolve(fmt, packed, stacked=False)
    for m in (1, 2, 7, 16):
        x = _randn(m, k, seed=m).bfloat16()
        ref = x.double() @ w.T
        out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
        for fast in {False, gemm.fast_int4(wk, x.dtype)}:  # the generic and (int4) packed-bf16 decoders
            y = gemv.gemv(x, wk, out.clone(), cfg, _cuda_tickets, fast_int4=fast)
            assert_within(y, ref, matmul_bound(x, w, ref, 2.0**-8))
        assert_within(kernels.dequant_linear(x, fmt, packed), ref, matmul_bound(x, w, ref, 2.0**-8))


@gpu
def test_gpu_tma_bf16_against_fp64_and_decoders_agree():
    packed, w = random_weight("int4", (384, 2048), seed=1, device="cuda")
    wk = resolve("int4", packed, stacked=False)
    shipped = replace(configs._GEMV_TALL, k_iters=1)  # the dispatched tiles, split so the ticket tail runs too
    wide = GemvConfig(16, 64, 256, k_iters=1, num_warps=4, num_stages=3, tma=True)
    for m in (1, 7, 16):
        x = _randn(m, 2048, seed=m).bfloat16()
        ref = x.double() @ w.T
        for cfg in (shipped, wide):
            y = gemv.gemv(x, wk, torch.empty((m, 384), dtype=torch.bfloat16, device="cuda"), cfg, _cuda_tickets, True)
            assert_within(y, ref, matmul_bound(x, w, ref, 2.0**-8))
        # the generic decoder (the interpreter's path) gives the same bits
        generic = gemv.gemv(x, wk, torch.empty_like(y), wide, _cuda_tickets, fast_int4=False)
        assert torch.equal(y, generic)


@gpu
def test_gpu_packed_decoder_is_bitwise_the_generic_one():
    # Same dequantized bf16 values in the same K order and the same mma sequence: identical bits.
    packed, _ = random_weight("int4", (512, 4096), seed=3, device="cuda")
    wk = resolve("int4", packed, stacked=False)
    x = _randn(16, 4096, seed=4).bfloat16()
    cfg = GemvConfig(16, 32, 128, k_iters=4)
    outs = [gemv.gemv(x, wk, torch.empty(16, 512, dtype=torch.bfloat16, device="cuda"), cfg,
                      _cuda_tickets, fast_int4=fast) for fast in (True, False)]  # fmt: skip
    assert torch.equal(outs[0], outs[1])


@gpu
def test_gpu_decode_is_deterministic_and_graph_capturable():
    packed, w = random_weight("int4", (6144, 4096), seed=9, device="cuda")
    for m in (1, 16):
        x = _randn(m, 4096, seed=10).bfloat16()
        first = kernels.int4_linear(x, packed)  # split-K with the ticket reduction
        assert all(torch.equal(first, kernels.int4_linear(x, packed)) for _ in range(5))
        ref = x.double() @ w.T
        assert_within(first, ref, matmul_bound(x, w, ref, 2.0**-8))
        static_x = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = kernels.int4_linear(static_x, packed)
        for seed in (11, 12):  # replays with new inputs re-arm the tickets
            static_x.copy_(_randn(m, 4096, seed=seed).bfloat16())
            graph.replay()
            assert torch.equal(static_y, kernels.int4_linear(static_x, packed))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_timeline_stamps_every_program_in_order_and_change_no_result():
    """kernels/timeline.py through the split GEMV: one stamped row per program, entry <= exit, cycle counts in
    program order (entry, after the PDL wait, end of the loop, exit), and the same output bits as without stamps."""
    from orbit_lightning.kernels.timeline import CYCLES, ENTRY_NS, EXIT_NS, SLOTS, SM_ID

    packed, _ = random_weight("int4", (4096, 4096), seed=9, device="cuda")
    w = resolve("int4", packed, stacked=False)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    cfg = configs.GEMV_ONE_ROW  # the split kernel's M = 1 tiles (the dispatched mma kernel splits K within programs)
    tickets = lambda n: gemm._tickets(x.device, n)  # noqa: E731
    plain = gemv.gemv(x, w, torch.empty((1, w.n), device="cuda", dtype=x.dtype), cfg, tickets, True)
    stamps = torch.zeros((1 << 14, SLOTS), dtype=torch.int64, device="cuda")
    stamped = gemv.gemv(x, w, torch.empty_like(plain), cfg, tickets, True, stamps=stamps)
    assert torch.equal(stamped, plain)
    rows = stamps[stamps[:, ENTRY_NS] > 0]
    n_tiles, step = triton.cdiv(w.n, cfg.block_n), cfg.block_k * (2 if cfg.two_tiles else 1)
    splits = triton.cdiv(4096, configs.gemv_splits(cfg, n_tiles, 4096, x.device, step) * step)
    assert splits > 1  # the split kernel's grid: N tiles x K splits, one row per program, packed
    assert rows.shape[0] == n_tiles * splits and (stamps[rows.shape[0] :] == 0).all()
    assert (rows[:, EXIT_NS] >= rows[:, ENTRY_NS]).all()
    for slot in (CYCLES + 1, CYCLES + 2, CYCLES + 3):  # (after the PDL wait, the loop's end, exit)
        assert (rows[:, slot] >= rows[:, slot - 1]).all(), slot
    assert rows[:, SM_ID].max().item() < torch.cuda.get_device_properties(0).multi_processor_count


def test_the_gemvs_refuse_a_stamp_buffer_they_would_overrun():
    """The decode GEMVs write timeline.SLOTS int64 per program into `stamps` unchecked: launch_args refuses a buffer
    too small, of another dtype or not contiguous (timeline.check_stamps), and takes one of exactly its programs."""
    from orbit_lightning.kernels.gemv_out import launch_args
    from orbit_lightning.kernels.timeline import SLOTS

    x = torch.zeros(1, 256, dtype=torch.float32)
    assert launch_args(x, 64, None, 16, 16, None, 4, torch.zeros(4, SLOTS, dtype=torch.int64)).constexprs["STAMPS"]
    for bad in (torch.zeros(3, SLOTS, dtype=torch.int64), torch.zeros(4, SLOTS, dtype=torch.int32),
                torch.zeros(SLOTS, 4, dtype=torch.int64).T):
        with pytest.raises(ValueError, match=r"stamps: need a contiguous int64 tensor of at least \[4, 8\]"):
            launch_args(x, 64, None, 16, 16, None, 4, bad)
