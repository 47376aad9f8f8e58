"""Small-M (decode) forward kernel, gemv.py: interpreter tests against float64 oracles on the CPU, and
bf16 / determinism / dispatch checks on the GPU.

CPU bound: the kernel multiplies the dequantized weight (exact, or rounded once in fp32) by the
activations and accumulates in fp32 in some order, so |y - ref| <= (K + 2) 2^-24 (sum_k |x||w| + |ref|)
(fp16 activations add one fp16 rounding of each weight and of the output, 2^-11 each). GPU bf16 bound:
as in test_gpu.py, each weight rounds once to bf16 (2^-9), products are exact, the fp32 sum adds
K * 2^-24 (< 2^-12 here) and the output rounds once (2^-9): 2^-8 (sum |x||w| + |ref|) holds with margin.
"""


import pytest
import torch
import triton
import triton.language as tl
from orbit_lightning.kernels import gemm, gemv, lora
from orbit_lightning.kernels.configs import GemvConfig
from orbit_lightning.kernels.formats import resolve

from orbit_lightning import kernels
from tests.kernels.kernel_oracles import assert_within, matmul_bound, random_weight

# (N, K): odd N (a partial last row tile; fp8's spans two 128-row scale blocks) and K not a multiple of
# the 64-wide K tile used below (int4-g128: K = 384 is 6 tiles of 64 but 3 groups: tiles inside a group).
SHAPES = {
    "int4": (41, 160),
    "int4-g128": (23, 384),
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


def _run(x, fmt, packed, cfg, term=None):
    w = resolve(fmt, packed, stacked=False)
    out = torch.empty((x.shape[0], w.n), dtype=x.dtype, device=x.device)
    return gemv.gemv(x, w, out, cfg, lambda n: gemm._tickets(x.device, n), fast_int4=False, lora=term)


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


# ------------------------------------------------------------------------------------ LoRA epilogue
SCALE = 1.7


def _lora_inputs(m, k, n, r, dtype, seed=0, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, generator=g, device=device).to(dtype)
    a = (0.2 * torch.randn(r, k, generator=g, device=device)).to(dtype)
    b = (0.2 * torch.randn(n, r, generator=g, device=device)).to(dtype)
    return x, a, b


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("variant", ["dot", "dot-split"])
@pytest.mark.parametrize("fmt", list(SHAPES))
def test_gemv_lora_epilogue_is_bitwise_lora_add(fmt, variant, dtype):
    # Bitwise: both round the same fp32 tile to the output dtype, then add lora.lora_delta of the same partials
    # (slice-order sum, the same roundings); its t B^T is a tl.dot, which the interpreter (numpy's matmul) sums
    # in rank order whatever the tile shape, so the GEMV's 16-wide tiles and lora_up's 64-wide ones agree.
    n, k = SHAPES[fmt]
    packed, _ = random_weight(fmt, (n, k), seed=1)
    for m in (1, 16):
        x, a, b = _lora_inputs(m, k, n, 5, dtype, seed=m)
        plain = _run(x, fmt, packed, CPU_CONFIGS[variant])
        fused = _run(x, fmt, packed, CPU_CONFIGS[variant], lora.lora_down(x, a, b, SCALE))
        assert torch.equal(fused, lora.lora_add(plain, x, a, b, SCALE))


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("variant", ["dot-two", "dot-two-noprefetch", "fma", "fma-split"])
def test_gemv_lora_epilogue_other_configs(variant):
    n, k, r = 37, 224, 16
    packed, _ = random_weight("int4", (n, k), seed=6)
    cfg = CPU_CONFIGS[variant]
    for m in (1, 16):
        x, a, b = _lora_inputs(m, k, n, r, torch.float32, seed=m)
        want = lora.lora_add(_run(x, "int4", packed, cfg), x, a, b, SCALE)
        fused = _run(x, "int4", packed, cfg, lora.lora_down(x, a, b, SCALE))
        if cfg.dot:
            assert torch.equal(fused, want)
        else:
            # FMA tiles may be narrower than tl.dot's 16 rows, so the rank sum runs in registers (tl.sum) in
            # another order than lora_up's dot: fp32 sums of r products differ by <= r ulps of sum |t||b|, and
            # the delta's and the output's roundings add one ulp each.
            t = x.double() @ a.double().T
            bound = (r + 2) * 2.0**-23 * (SCALE * t.abs() @ b.double().abs().T + want.double().abs())
            assert_within(fused, want.double(), bound)


@pytest.mark.usefixtures("cpu_kernels")
def test_gemv_lora_epilogue_rejects_a_term_of_other_rows():
    packed, _ = random_weight("int4", (24, 64), seed=4)
    x, a, b = _lora_inputs(3, 64, 24, 4, torch.float32)
    with pytest.raises(ValueError, match="does not fit"):
        _run(x[:2], "int4", packed, CPU_CONFIGS["dot"], lora.lora_down(x, a, b, SCALE))


@pytest.mark.usefixtures("cpu_kernels")
def test_dequant_linear_adds_lora_in_the_gemv_where_it_routes_there(monkeypatch):
    packed, _ = random_weight("int4", (24, 64), seed=4)
    calls = []
    real_gemv, real_up = gemv.gemv, lora.lora_up
    monkeypatch.setattr(gemm, "gemv", lambda *a, **kw: calls.append(("gemv", kw["lora"] is not None))
                        or real_gemv(*a, **kw))  # fmt: skip
    monkeypatch.setattr(lora, "lora_up", lambda *a: calls.append(("lora_up",)) or real_up(*a))
    for m, kw, route in [(6, {}, [("gemv", True)]),  # decode: one launch for y and the LoRA
                         (17, {}, [("lora_up",)]),  # above the decode bucket: the tile GEMM, then lora_up
                         (6, {"config": kernels.TileConfig(16, 32, 32)}, [("lora_up",)])]:  # fmt: skip
        calls.clear()
        x, a, b = _lora_inputs(m, 64, 24, 4, torch.float32, seed=m)
        y = kernels.dequant_linear(x.view(2, m // 2, 64) if m == 6 else x, "int4", packed,
                                   lora=lora.lora_down(x, a, b, SCALE), **kw).reshape(m, 24)  # fmt: skip
        assert calls == route
        assert torch.equal(y, lora.lora_add(kernels.int4_linear(x, packed, **kw), x, a, b, SCALE))
    calls.clear()
    with kernels.batch_invariant():  # its one fixed tile config, never the GEMV
        x, a, b = _lora_inputs(1, 64, 24, 4, torch.float32)
        kernels.dequant_linear(x, "int4", packed, lora=lora.lora_down(x, a, b, SCALE))
    assert calls == [("lora_up",)]


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
@pytest.mark.parametrize("bk", [32, 128])
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
              "nvfp4": (320, 768)}  # fmt: skip


def _gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test))


def _cuda_tickets(n: int) -> torch.Tensor:
    return gemm._tickets(torch.device("cuda", torch.cuda.current_device()), n)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator("cuda").manual_seed(seed), device="cuda")


@_gpu
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


@_gpu
def test_gpu_packed_decoder_is_bitwise_the_generic_one():
    # Same dequantized bf16 values in the same K order and the same mma sequence: identical bits.
    packed, _ = random_weight("int4", (512, 4096), seed=3, device="cuda")
    wk = resolve("int4", packed, stacked=False)
    x = _randn(16, 4096, seed=4).bfloat16()
    cfg = GemvConfig(16, 32, 128, k_iters=4)
    outs = [gemv.gemv(x, wk, torch.empty(16, 512, dtype=torch.bfloat16, device="cuda"), cfg,
                      _cuda_tickets, fast_int4=fast) for fast in (True, False)]  # fmt: skip
    assert torch.equal(outs[0], outs[1])


@_gpu
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


def _gpu_fused(x, wk, cfg, fast, a, b):
    out = torch.empty(x.shape[0], wk.n, dtype=x.dtype, device="cuda")
    return gemv.gemv(x, wk, out, cfg, _cuda_tickets, fast_int4=fast, lora=lora.lora_down(x, a, b, SCALE))


@_gpu
@pytest.mark.parametrize("fmt", list(GPU_SHAPES))
def test_gpu_bf16_lora_epilogue_against_fp64(fmt):
    n, k = GPU_SHAPES[fmt]
    packed, w = random_weight(fmt, (n, k), seed=1, device="cuda")
    wk = resolve(fmt, packed, stacked=False)
    for m in (1, 16):
        x, a, b = (t.bfloat16() for t in _lora_inputs(m, k, n, 16, torch.float32, seed=m, device="cuda"))
        xd, ad, bd = x.double(), a.double(), b.double()
        ref = xd @ w.T + SCALE * (xd @ ad.T) @ bd.T
        # Base as in test_gpu_bf16_against_fp64; the LoRA term rounds t, t B^T and its scaled value to bf16
        # (2^-9 each, so 2^-7 of SCALE |x||A^T||B^T| bounds them) and the sum once more (in the |ref| term).
        bound = matmul_bound(x, w, ref, 2.0**-8) + 2.0**-7 * SCALE * (xd.abs() @ ad.abs().T) @ bd.abs().T
        for cfg in (GemvConfig(16, 32, 128, k_iters=2), GemvConfig(16, 32, 128, k_iters=64)):  # split, no split
            for fast in {False, gemm.fast_int4(wk, x.dtype)}:
                y = _gpu_fused(x, wk, cfg, fast, a, b)
                assert_within(y, ref, bound)
                # the ordered split reduction and the epilogue: the same bits every run
                assert torch.equal(y, _gpu_fused(x, wk, cfg, fast, a, b))


@_gpu
def test_gpu_lora_decode_is_graph_capturable():
    packed, w = random_weight("int4", (1024, 4096), seed=9, device="cuda")
    x, a, b = (t.bfloat16() for t in _lora_inputs(1, 4096, 1024, 16, torch.float32, device="cuda"))
    fused = lambda: kernels.dequant_linear(x, "int4", packed, lora=lora.lora_down(x, a, b, SCALE))
    eager = fused()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = fused()
    for seed in (11, 12):  # replays with new inputs re-arm the tickets
        x.copy_(_randn(1, 4096, seed=seed).bfloat16())
        graph.replay()
        assert torch.equal(static_y, fused())
    assert not torch.equal(static_y, eager)
