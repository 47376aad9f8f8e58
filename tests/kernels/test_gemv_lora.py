"""LoRA inside the decode GEMV launch (kernels/gemv_lora.py): interpreter tests against a float64 oracle, the
tickets re-armed and the epoch advanced once per launch, the fallback where the adapters do not fit, and bf16 on
the GPU.

CPU bound (fp32 activations and adapters): the base part is test_gemv.py's (K + 2) 2^-24 of sum |x||w|; the
adapter part chains two fp32 dots (K, then r terms) and three roundings (t, B t, the scale), and the output adds
one: (K + r + 8) 2^-24 of (sum |x||w| + sum_g s_g (|x| |A_g|^T) |B_g|^T + |ref|) covers both with margin.
"""

import pytest
import torch
from orbit_lightning.kernels import gemm, gemv
from orbit_lightning.kernels.configs import GemvConfig
from orbit_lightning.kernels.formats import resolve
from orbit_lightning.kernels.gemv_lora import LoraDelta, fits, lora_state

from orbit_lightning import kernels
from tests.kernels.kernel_oracles import assert_within, random_weight

CONFIGS = {
    "one-split": GemvConfig(16, 16, 64, k_iters=0),
    "split": GemvConfig(16, 16, 32, k_iters=1),  # several K splits: the last arriver adds the delta
    "tma": GemvConfig(16, 16, 256, k_iters=1, tma=True, num_stages=2),
}


def _adapters(ns, k, r, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = [torch.randn(r, k, generator=g).to(dtype) / k**0.5 for _ in ns]
    b = [torch.randn(n, r, generator=g).to(dtype) for n in ns]
    return LoraDelta(a, b, [0.5 * (i + 1) for i in range(len(ns))])


def _oracle(x, w, delta):
    """float64 x W^T + sum_g s_g (x A_g^T) B_g^T on adapter g's columns, and the error scale of the bound."""
    xd = x.double()
    ref, mag = xd @ w.T, xd.abs() @ w.abs().T
    col = 0
    for a, b, s in zip(delta.a, delta.b, delta.scale):
        n = b.shape[0]
        ref[:, col : col + n] += s * (xd @ a.double().T) @ b.double().T
        mag[:, col : col + n] += s * (xd.abs() @ a.double().abs().T) @ b.double().abs().T
        col += n
    return ref, mag


def _run(x, packed, cfg, delta, tickets):
    w = resolve("int4", packed, stacked=False)
    out = torch.empty((x.shape[0], w.n), dtype=x.dtype, device=x.device)
    return gemv.gemv(x, w, out, cfg, lambda n: tickets[:n], fast_int4=False, lora=delta)


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("variant", list(CONFIGS))
@pytest.mark.parametrize("ns", [(48,), (32, 16, 16)], ids=["one-adapter", "three-adapters"])
@pytest.mark.parametrize("k", [512, 160], ids=["k512", "k160"])
def test_fused_lora_matches_fp64(variant, ns, k):
    # K = 512: two 256-wide rank slices (four 128-wide at M = 1); K = 160: one partial slice, masked. Rank 4 pads
    # to 16.
    # (At K = 160 the "tma" config's boxes do not fit, so gemv runs the pointer kernel with its tiles.)
    r = 4
    packed, w = random_weight("int4", (sum(ns), k), seed=3)
    delta = _adapters(ns, k, r)
    tickets = torch.zeros(64, dtype=torch.int32)
    state = lora_state(torch.device("cpu"))
    for m in (1, 3):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        epoch = int(state[0]) >> 32
        y = _run(x, packed, CONFIGS[variant], delta, tickets)
        ref, mag = _oracle(x, w, delta)
        assert_within(y, ref, (k + r + 8) * 2.0**-24 * (mag + ref.abs()))
        assert not tickets.any(), "the kernel must re-arm every ticket it used"
        assert int(state[0]) == (epoch + 1) << 32, "one launch: the epoch advances by one, the arrivals clear"
        assert torch.equal(_run(x, packed, CONFIGS[variant], delta, tickets), y)  # run again: the same bits


@pytest.mark.usefixtures("cpu_kernels")
def test_dense_gemm_falls_back_to_the_lora_kernels_where_the_adapters_do_not_fit():
    k = 256
    packed, w = random_weight("int4", (40, k), seed=4)
    delta = _adapters((24, 16), k, 8)  # the boundary at 24 is not a multiple of the 16-row tile
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(5))
    assert not fits(delta, x, 40, 16, 16)
    y = kernels.dequant_linear(x, "int4", packed, lora=delta)
    want = kernels.lora_add_many(kernels.dequant_linear(x, "int4", packed), x, *delta)
    assert torch.equal(y, want)
    ref, mag = _oracle(x, w, delta)
    assert_within(y, ref, (k + 16) * 2.0**-24 * (mag + ref.abs()))


def test_fits_rejects_what_the_fused_path_cannot_take():
    x = torch.randn(2, 64)
    ok = _adapters((16, 16), 64, 8)
    assert fits(ok, x, 32, 16, 16)
    assert not fits(ok, x, 48, 16, 16)  # outputs do not add up to N
    assert not fits(ok, torch.randn(17, 64), 32, 16, 16)  # more rows than one M tile
    assert not fits(_adapters((8, 8, 8, 8), 64, 8), x, 32, 16, 8)  # four adapters
    mixed = LoraDelta([ok.a[0], ok.a[1][:4]], ok.b, ok.scale)
    assert not fits(mixed, x, 32, 16, 16)  # ranks differ


def test_the_mma_gemv_takes_the_adapters_into_its_launch_at_one_row_and_long_k_only():
    """configs.fuse_lora, as the dispatch (gemm.dense_gemm) asks it: the shipped mma GEMV configs fuse at M = 1 from
    K = 4096 and leave 2-8 rows and shorter K to lora_add_many (measured slower fused, bench/RESULTS.md); the tile
    kernels fuse at every M and K."""
    configs = kernels.configs
    mma = [configs._GEMV_MMA, configs._GEMV_MMA_LONG_K, configs._GEMV_MMA_ONE_TILE, configs._GEMV_MMA_TWO_ROWTILES]
    for cfg in mma:  # rows: K = 2048, 4096, 16384; columns: M = 1, 2, 8
        got = [[configs.fuse_lora(m, k, cfg) for m in (1, 2, 8)] for k in (2048, 4096, 16384)]
        assert got == [[False, False, False], [True, False, False], [True, False, False]], cfg
    tiles = [cfg for _, cfg in configs.GEMV_TILES] + [configs._GEMV_CPU]
    assert all(configs.fuse_lora(m, k, cfg) for cfg in tiles for m in (1, 2, 8, 16) for k in (512, 4096))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("shape", [(6144, 4096, (4096, 1024, 1024)), (24576, 4096, (12288, 12288)),
                                   (4096, 12288, (4096,)), (7168, 16384, (7168,))],
                         ids=["qkv", "gate_up", "down", "o-long-k"])  # fmt: skip
def test_fused_lora_bf16_gpu_matches_fp64(shape, m, monkeypatch):
    """The engine's shapes through the dispatched small-M kernel (at M <= 8 gemv_mma.py's) with the adapters in its
    launch, against the fp64 oracle. Bound: the base GEMV's 2^-8 (sum |x||w| + |ref|) (test_gemv.py); the adapter
    path rounds t, B t, the scaled delta and the sum to bf16, 2^-9 each of at most sum_g s_g (|x| |A_g|^T) |B_g|^T
    + |ref|: 2^-7 covers both. The unfused kernels (lora_add_many after the GEMV) must meet the same bound: the two
    round t from different fp32 sums (FMA slices here, tensor-core slices there), so their bits may differ. Where
    configs.fuse_lora says no (the mma GEMV at 2-8 rows, or K < 4096), the dispatch is the unfused pair, bit for bit."""
    monkeypatch.setattr(kernels.configs, "WGMMA_INT4", False)  # (16 rows on Hopper: wgmma_int4, LoRA after it)
    n, k, ns = shape
    packed, w = random_weight("int4", (n, k), seed=6, device="cuda")
    delta = _adapters(ns, k, 16, torch.bfloat16)
    delta = LoraDelta([t.cuda() for t in delta.a], [t.cuda() for t in delta.b], delta.scale)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    wk = resolve("int4", packed, stacked=False)
    cfg = kernels.configs.pick_gemv(m, x.device, x.dtype, True, wk)

    def in_launch():
        return gemv.gemv(x, wk, torch.empty((m, n), dtype=x.dtype, device=x.device), cfg,
                         lambda c: gemm._tickets(x.device, c), True, delta)  # fmt: skip

    fused = in_launch()
    unfused = kernels.lora_add_many(kernels.dequant_linear(x, "int4", packed), x, *delta)
    dispatched = kernels.dequant_linear(x, "int4", packed, lora=delta)
    assert torch.equal(dispatched, fused if kernels.configs.fuse_lora(m, k, cfg) else unfused)
    state = lora_state(x.device)
    epoch = int(state[0]) >> 32
    assert torch.equal(in_launch(), fused)  # deterministic, re-armed
    assert not gemm._tickets(x.device, 0).any()
    assert int(state[0]) == (epoch + 1) << 32
    ref, mag = _oracle(x.double().cpu(), w.cpu(), LoraDelta([t.cpu() for t in delta.a], [t.cpu() for t in delta.b],
                                                           delta.scale))  # fmt: skip
    bound = 2.0**-7 * (mag + ref.abs())
    assert_within(fused.cpu(), ref, bound)
    assert_within(unfused.cpu(), ref, bound)
