"""The batch-1 mma GEMV (kernels/gemv_mma.py): its warp split on the CPU, and on the GPU bf16 results against the
float64 oracle, with LoRA in the launch, determinism, graph replay and the dispatch.

The kernel is inline PTX: under the interpreter its loads and mma are emulated per lane (kernels/emulate.py), which
runs the kernel's addressing, warp split and epilogue on the CPU (bound 2^-7: the interpreter's bf16 casts truncate,
so the output may be one bf16 ulp off instead of half); tests/kernels/test_compile_sm90.py compiles the PTX. GPU bound:
test_gemv.py's 2^-8 (sum |x||w| + |ref|): each weight rounds once to bf16 by the same decoder, products are exact
in the mma, the fp32 sum adds K 2^-24 and the output rounds once. With adapters, test_gemv_lora.py's 2^-7.
"""

from dataclasses import replace

import pytest
import torch
from orbit_lightning.kernels import configs, gemm, gemv
from orbit_lightning.kernels.configs import GemvConfig
from orbit_lightning.kernels.formats import resolve
from orbit_lightning.kernels.gemv_lora import LoraDelta
from orbit_lightning.kernels.gemv_mma import _decode, mma_split, tile_asm, warps_for

from orbit_lightning import kernels
from orbit_lightning.quant.formats import get_format
from orbit_lightning.quant.formats.tiled import tile_tensor
from tests.kernels.kernel_oracles import assert_within, gpu, matmul_bound, random_weight, row_major
from tests.kernels.ptx_text import int4_decode_cases, int4_decoded_bits, run_ptx, run_ptx_warp
from tests.kernels.test_gemv_lora import _adapters, _oracle


def test_warps_split_k_evenly_and_fill_the_sms():
    cfg = GemvConfig(16, 32, 128, mma=True, num_warps=8, programs_per_sm=12)
    assert warps_for(cfg, 6144 // 32, 4096, 132) == 8  # 192 programs want 9 warps each: capped at 8, 4 K tiles per warp
    assert warps_for(cfg, 24576 // 32, 4096, 132) == 4  # 768 programs want 3: the next power of two
    assert warps_for(cfg, 4096 // 32, 1536, 132) == 4  # 12 K tiles: 8 warps would not divide them
    assert warps_for(cfg, 4096 // 32, 7168, 132) == 8  # 56 tiles
    assert warps_for(cfg, 1 << 15, 4096, 132) == 1  # enough programs already
    assert warps_for(cfg, 1, 128, 132) == 1  # one K tile
    assert warps_for(replace(cfg, mma_tiles=4), 4096 // 32, 1536, 132) == 1  # 3 steps of 4 tiles
    assert mma_split(cfg, 6144, 4096, 132) == (192, 8, 4)  # 32-row programs, 8 warps of 4 K tiles each
    with pytest.raises(ValueError, match="block_n 16 or 32"):
        GemvConfig(16, 64, 128, mma=True)
    with pytest.raises(ValueError, match="mma_tiles"):
        GemvConfig(16, 16, 128, mma=True, mma_tiles=3)


def test_the_mma_kernel_serves_only_what_it_reads():
    cfg = configs._GEMV_MMA_ONE_TILE
    for fmt, shape, ok in [("int4", (64, 256), True), ("int4-g128", (64, 384), True), ("int4", (64, 160), False),
                           ("int4", (40, 256), False), ("fp8", (64, 256), False), ("int4-tiled", (64, 512), True),
                           ("int4-g64-tiled", (32, 512), True)]:  # fmt: skip
        packed, _ = random_weight(fmt, shape, seed=0)
        assert configs.mma_ok(resolve(fmt, packed, stacked=False), cfg) == ok, (fmt, shape)
    packed, _ = random_weight("int4", (64, 384), seed=0)  # 3 K tiles: not whole steps of 2
    assert not configs.mma_ok(resolve("int4", packed, stacked=False), replace(cfg, mma_tiles=2))
    packed, _ = random_weight("int4", (40, 384), seed=0)  # the kernels take int4-tiled only in whole 16 x 128 blocks
    with pytest.raises(ValueError, match="whole blocks of 16 rows x 128"):
        resolve("int4-tiled", packed, stacked=False)


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("case", ["one-warp", "two-rowtiles", "g128-two-warps", "one-tile-steps", "pairs-two-rowtiles",
                                  "pairs-g128-two-warps", "pairs-one-tile-steps", "pairs-g64",
                                  "interleaved-k", "pairs-interleaved-k", "tiled-two-rowtiles",
                                  "pairs-tiled-interleaved-k", "tiled-g64", "tiled-g128-one-tile-steps",
                                  "tiled-one-tile-steps"])
def test_mma_gemv_under_the_interpreter(case):
    """(The LoRA in the launch is left to the GPU tests: under the interpreter bf16 adapters give wrong deltas in the
    tile kernels too, an interpreter limit this emulation does not touch.)"""
    n, k, cfg, fmt = {
        "one-warp": (64, 256, GemvConfig(16, 16, 128, mma=True, num_warps=1, mma_tiles=2), "int4"),
        "two-rowtiles": (96, 512, GemvConfig(16, 32, 128, mma=True, num_warps=2, mma_tiles=2), "int4"),
        "g128-two-warps": (32, 1024, GemvConfig(16, 16, 128, mma=True, num_warps=2, mma_tiles=2), "int4-g128"),
        "one-tile-steps": (48, 384, GemvConfig(16, 16, 128, mma=True, num_warps=1), "int4"),
        # lane t takes words 2t, 2t + 1, 2t + 8, 2t + 9: two scale groups a lane at group 32, one at 128
        "pairs-two-rowtiles": (96, 512, GemvConfig(16, 32, 128, mma=True, num_warps=2, mma_tiles=2,
                                                   mma_word_pairs=True), "int4"),
        "pairs-g128-two-warps": (32, 1024, GemvConfig(16, 16, 128, mma=True, num_warps=2, mma_tiles=2,
                                                      mma_word_pairs=True), "int4-g128"),
        "pairs-one-tile-steps": (48, 384, GemvConfig(16, 16, 128, mma=True, num_warps=1, mma_word_pairs=True), "int4"),
        "pairs-g64": (32, 512, GemvConfig(16, 16, 128, mma=True, num_warps=2, mma_word_pairs=True), "int4-g64"),
        # warp w takes K steps w, w + 2, ...: 3 steps a warp of 2 tiles, so a mutation of either stride shows
        "interleaved-k": (32, 1536, GemvConfig(16, 16, 128, mma=True, num_warps=2, mma_tiles=2,
                                               mma_interleave_k=True), "int4"),
        "pairs-interleaved-k": (32, 1536, GemvConfig(16, 16, 128, mma=True, num_warps=4, mma_word_pairs=True,
                                                     mma_interleave_k=True), "int4"),
        # int4-tiled: 3 programs of 2 row tiles (two 16-row blocks apart), 2 warps of 2 steps each
        "tiled-two-rowtiles": (96, 1024, GemvConfig(16, 32, 128, mma=True, num_warps=2, mma_tiles=2), "int4-tiled"),
        "pairs-tiled-interleaved-k": (48, 1536, GemvConfig(16, 16, 128, mma=True, num_warps=4, mma_word_pairs=True,
                                                           mma_interleave_k=True), "int4-tiled"),
        "tiled-g64": (64, 1024, GemvConfig(16, 16, 128, mma=True, num_warps=2, mma_tiles=2), "int4-g64-tiled"),
        "tiled-one-tile-steps": (32, 768, GemvConfig(16, 16, 128, mma=True, num_warps=2), "int4-tiled"),
        # one K tile a step at group 128: a scale block row (8 groups) spans 8 steps, warp 1 starts in mid-block
        "tiled-g128-one-tile-steps": (32, 1024, GemvConfig(16, 16, 128, mma=True, num_warps=2, mma_word_pairs=True),
                                      "int4-g128-tiled"),
    }[case]
    packed, w = random_weight(fmt, (n, k), seed=4)
    wk = resolve(fmt, packed, stacked=False)
    assert configs.mma_ok(wk, cfg)
    for m in (1, 3, 8, 9, 16):  # one n8 tile of activation rows (a partial one), two (one partial)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
        y = gemv.gemv(x, wk, torch.empty((m, n), dtype=torch.bfloat16), cfg,
                      _cpu_tickets, True)  # fmt: skip
        ref = x.double() @ w.T
        assert_within(y, ref, matmul_bound(x, w, ref, 2.0**-7))


def test_decode_text_matches_the_int4_format():
    """The tile's decode of one word (its PTX text, run by a small interpreter: the kernel runs only on a GPU) leaves
    in register j the int4 format's own dequantized values j and j + 4 of the word, bit for bit, for every nibble
    value and a range of scales: the pairs its mmas multiply by activations permuted the same way (tile_asm)."""
    consts = "mov.b32 one, 0x3F803F80;\nmov.b32 off, 0xC308C308;\nmov.b32 nz, 0x80008000;\n"
    text = consts + _decode("$0", "a").replace("{s2}", "$1")
    for word, scale in zip(*int4_decode_cases((24,))):
        want = int4_decoded_bits(word, scale)
        bits = scale.view(torch.int16).item() & 0xFFFF
        regs = run_ptx(text, {"$0": word.item() & 0xFFFFFFFF, "$1": bits | bits << 16})
        for j in range(4):
            assert regs[f"a{j}"] == want[j].item() | want[j + 4].item() << 16, (hex(word.item()), j)


@pytest.mark.parametrize("nt", [1, 2])
@pytest.mark.parametrize("pairs", [False, True], ids=["words", "pairs"])
@pytest.mark.parametrize("tiled", [False, True], ids=["row-major", "tiled"])
def test_tile_text_multiplies_a_row_tile(nt, pairs, tiled):
    """tile_asm's whole PTX for one row tile x one K tile, run for the 32 lanes of a warp (the mma exchanged across
    them as the PTX ISA defines its fragments), from registers loaded as the kernel's lanes load them (row-major
    words or int4-tiled's pair order; the words or the word-pair lane layout; 8 or 16 activation rows): D = C + the
    products of the int4 format's own bf16 weights and the activations, within fp32 rounding. A value paired with
    the wrong activation (a nibble order or permute astray) is off by the size of the products themselves."""
    fmt = get_format("int4")  # g32: a lane's 32 values (or each pair of words) one group
    packed = fmt.random_packed((16, 128), generator=torch.Generator().manual_seed(nt + 2 * pairs + 4 * tiled))
    w = fmt.dequantize(packed, torch.bfloat16).double()  # [16 rows, 128]
    words = tile_tensor("weight_packed", packed["weight_packed"]) if tiled else packed["weight_packed"]
    words, scale = words.tolist(), packed["weight_scale"].view(torch.int16).tolist()  # [16, 16], [16, 4] bits
    x = torch.randn(8 * nt, 128, generator=torch.Generator().manual_seed(7)).bfloat16()
    xbits = x.view(torch.int16).int() & 0xFFFF
    c0 = torch.randn(8 * nt, 16, generator=torch.Generator().manual_seed(8)).float()  # C [columns, rows]
    base = 4 * nt  # operands: D (4 nt), words (8), scales (2 h or 4 bf16x2), x (16 a tile), C (4 nt)
    xs = base + (12 if pairs else 10)
    lanes = []
    for lane in range(32):
        g, t = lane // 4, lane % 4
        cols = [4 * t + i for i in range(4)] if not pairs else [2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9]
        ks = [8 * c for c in cols]  # each word's first K
        regs = {f"${base + i}": words[g][c] & 0xFFFFFFFF for i, c in enumerate(cols)}
        regs.update({f"${base + 4 + i}": words[g + 8][c] & 0xFFFFFFFF for i, c in enumerate(cols)})
        if pairs:  # bf16x2 of each row's scale for its first and second pair of words
            for i, (row, k) in enumerate(((g, ks[0]), (g, ks[2]), (g + 8, ks[0]), (g + 8, ks[2]))):
                bits = scale[row][k // 32] & 0xFFFF
                regs[f"${base + 8 + i}"] = bits | bits << 16
        else:
            regs[f"${base + 8}"], regs[f"${base + 9}"] = scale[g][t] & 0xFFFF, scale[g + 8][t] & 0xFFFF
        for j in range(nt):  # activation row g + 8 j, the words' K values in pairs
            for i in range(16):
                k = ks[i // 4] + 2 * (i % 4)
                regs[f"${xs + 16 * j + i}"] = xbits[g + 8 * j, k].item() | xbits[g + 8 * j, k + 1].item() << 16
            for i, (row, col) in enumerate(((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1))):
                regs[f"${xs + 16 * nt + 4 * j + i}"] = c0[8 * j + col, row].item()
        lanes.append(regs)
    out = run_ptx_warp(tile_asm(nt, pairs, tiled), lanes)
    ref = c0.double() + x.double() @ w.T  # [columns, rows]
    bound = 2.0**-20 * (c0.double().abs() + x.double().abs() @ w.abs().T)
    for lane, regs in enumerate(out):
        g, t = lane // 4, lane % 4
        for j in range(nt):
            for i, (row, col) in enumerate(((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1))):
                got, want = regs[f"${4 * j + i}"], ref[8 * j + col, row].item()
                assert abs(got - want) <= bound[8 * j + col, row].item(), (lane, j, i, got, want)


def _tickets(n: int) -> torch.Tensor:
    return gemm._tickets(torch.device("cuda", torch.cuda.current_device()), n)


def _cpu_tickets(n: int) -> torch.Tensor:
    return torch.zeros(max(n, 1024), dtype=torch.int32)


_MMA = configs._GEMV_MMA
CASES = {  # name: (format, N, K, config)
    "qkv-shipped": ("int4", 6144, 4096, _MMA),
    "down-longK": ("int4", 4096, 12288, _MMA),
    "g128-56tiles": ("int4-g128", 512, 7168, _MMA),
    "two-rowtiles": ("int4", 272 + 16, 1536, GemvConfig(16, 32, 128, mma=True, num_warps=4)),
    "one-warp": ("int4", 64, 256, GemvConfig(16, 32, 128, mma=True, num_warps=1)),
    "16-warps": ("int4", 1024, 4096, GemvConfig(16, 32, 128, mma=True, num_warps=16, programs_per_sm=64)),
    "4-tile-steps-l2-256": ("int4", 512, 2048, replace(_MMA, mma_tiles=4, l2_prefetch=256)),
    "2-tile-steps-l2-128": ("int4-g128", 2048, 1024, replace(_MMA, mma_tiles=2, l2_prefetch=128, block_n=32)),
    "pairs-shipped": ("int4", 6144, 4096, replace(_MMA, mma_word_pairs=True)),
    "pairs-g128-two-rowtiles": ("int4-g128", 2048, 1024, replace(_MMA, block_n=32, mma_word_pairs=True)),
    "pairs-one-tile-steps": ("int4", 1024, 1536, replace(configs._GEMV_MMA_ONE_TILE, mma_word_pairs=True)),
    "pairs-g64": ("int4-g64", 1024, 2048, replace(_MMA, mma_word_pairs=True)),
    "pairs-9-16-rows": ("int4", 4096, 4096, configs._at_rows(_MMA, 16)),  # one K tile a step, no L2 prefetch hint
    "interleaved-k": ("int4", 4096, 12288, replace(_MMA, mma_interleave_k=True)),
    "pairs-9-16-rows-interleaved-k": ("int4", 4096, 4096, replace(configs._at_rows(_MMA, 16), mma_interleave_k=True)),
    "long-k-shipped-g128": ("int4-g128", 2048, 16384, configs._GEMV_MMA_LONG_K),  # two row tiles, interleaved K
    "long-k-runs": ("int4", 1024, 16384, replace(configs._GEMV_MMA_LONG_K, mma_interleave_k=False)),
    # int4-tiled weights
    "tiled-shipped": ("int4-tiled", 4096, 4096, _MMA),
    "tiled-9-16-rows-g128": ("int4-g128-tiled", 2048, 4096, configs._at_rows(_MMA, 16)),
    "tiled-long-k": ("int4-tiled", 1024, 16384, configs._GEMV_MMA_LONG_K),  # two row tiles
}


@gpu
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_mma_gemv_matches_fp64_deterministically(case):
    fmt, n, k, cfg = CASES[case]
    packed, w = random_weight(fmt, (n, k), seed=2, device="cuda")
    wk = resolve(fmt, packed, stacked=False)
    rows = resolve(*row_major(fmt, packed), stacked=False) if wk.tiled else wk
    assert configs.mma_ok(wk, cfg)
    for m in (1, 3, 8, 9, 16):  # one n8 tile of activation rows (a partial one), two (one partial)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        y = gemv.gemv(x, wk, torch.empty((m, n), dtype=torch.bfloat16, device="cuda"), cfg, _tickets, True)
        ref = x.double() @ w.T
        assert_within(y, ref, matmul_bound(x, w, ref, 2.0**-8))
        assert torch.equal(y, gemv.gemv(x, wk, torch.empty_like(y), cfg, _tickets, True))
        if wk.tiled:  # the same weights; each mma takes values 0-3 / 4-7 of a lane's word (row-major 0, 1, 4, 5 /
            # 2, 3, 6, 7: tile_asm), so the fp32 sums run in another order, and both stay within the bound
            assert_within(gemv.gemv(x, rows, torch.empty_like(y), cfg, _tickets, True), ref,
                          matmul_bound(x, w, ref, 2.0**-8))  # fmt: skip
        # The tile kernels multiply the same bf16 weights; only the fp32 summation order differs.
        split = gemv.gemv(x, rows, torch.empty_like(y), next(c for b, c in configs.GEMV_TILES if m <= b), _tickets,
                          True)  # fmt: skip
        assert_within(y, split.double(), matmul_bound(x, w, ref, 2.0**-8))


@gpu
def test_gpu_dispatch_lora_and_graph_replay():
    """int4_linear at M = 1 takes the mma kernel; three adapters ride in its launch (fp64 oracle, 2^-7 as in
    test_gemv_lora.py); a captured graph replays with new activations."""
    n, k, ns = 6144, 4096, (4096, 1024, 1024)
    packed, w = random_weight("int4", (n, k), seed=6, device="cuda")
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    assert configs.pick_gemv(1, x.device, x.dtype, True, resolve("int4", packed, stacked=False)).mma
    delta = _adapters(ns, k, 16, torch.bfloat16)
    delta = LoraDelta([t.cuda() for t in delta.a], [t.cuda() for t in delta.b], delta.scale)
    fused = kernels.dequant_linear(x, "int4", packed, lora=delta)
    ref, mag = _oracle(x.double().cpu(), w.cpu(), LoraDelta([t.cpu() for t in delta.a], [t.cpu() for t in delta.b],
                                                           delta.scale))  # fmt: skip
    assert_within(fused.cpu(), ref, 2.0**-7 * (mag + ref.abs()))
    assert torch.equal(kernels.dequant_linear(x, "int4", packed, lora=delta), fused)  # flags re-armed
    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = kernels.dequant_linear(static_x, "int4", packed, lora=delta)
    for seed in (1, 2):
        static_x.copy_(torch.randn(1, k, generator=torch.Generator("cuda").manual_seed(seed), device="cuda").bfloat16())
        graph.replay()
        assert torch.equal(static_y, kernels.dequant_linear(static_x, "int4", packed, lora=delta))


@gpu
@pytest.mark.parametrize("m", [2, 9, 16])
def test_gpu_dispatch_by_rows_and_weight_size(m, monkeypatch):
    """configs.pick_gemv's choice as dense_gemm runs it: at 9-16 rows the mma GEMV, one row tile a warp in word pairs,
    takes weights of fewer than MMA_WIDE_MAX_N rows (the small one, and a 4096-row one past MMA_SMALL_WEIGHT) and
    wgmma_int4 the tall one; at 2-8 rows tall matrices take two row tiles a warp. Each result against the fp64
    oracle, with adapters added after the launch."""
    ran = []
    real = gemm.gemv
    monkeypatch.setattr(gemm, "gemv", lambda *a, **kw: ran.append(a[3]) or real(*a, **kw))
    small, wide, tall = (2048, 4096), (4096, 8192), (max(16384, 32 * configs.sm_count(torch.device("cuda"))), 2048)
    # (at 9-16 rows MMA_WIDE_TILES K tiles a step; from MMA_WORD_PAIRS_FROM rows the word-pair layout)
    expect = {(n, k): configs._at_rows(configs._GEMV_MMA, m) for n, k in (small, wide)}
    expect[tall] = configs._at_rows(configs._GEMV_MMA_TWO_ROWTILES, m) if m <= 8 else None
    assert m <= 8 or expect[small].mma_word_pairs
    for (n, k), cfg in expect.items():
        packed, w = random_weight("int4", (n, k), seed=9, device="cuda")
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        delta = _adapters((n,), k, 8, torch.bfloat16)
        delta = LoraDelta([t.cuda() for t in delta.a], [t.cuda() for t in delta.b], delta.scale)
        ran.clear()
        y = kernels.dequant_linear(x, "int4", packed, lora=delta)
        assert ran == ([cfg] if cfg else []), (n, k, m)  # []: wgmma_int4 ran
        ref, mag = _oracle(x.double().cpu(), w.cpu(), LoraDelta([t.cpu() for t in delta.a],
                                                               [t.cpu() for t in delta.b], delta.scale))  # fmt: skip
        assert_within(y.cpu(), ref, 2.0**-7 * (mag + ref.abs()))


@gpu
@pytest.mark.parametrize("m", [1, 5, 16])
def test_gpu_lora_in_the_launch_at_several_rows(m):
    n, k, ns = 3072, 2048, (2048, 512, 512)
    packed, w = random_weight("int4", (n, k), seed=7, device="cuda")
    wk = resolve("int4", packed, stacked=False)
    delta = _adapters(ns, k, 16, torch.bfloat16)
    delta = LoraDelta([t.cuda() for t in delta.a], [t.cuda() for t in delta.b], delta.scale)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = gemv.gemv(x, wk, torch.empty((m, n), dtype=x.dtype, device="cuda"), _MMA, _tickets, True, lora=delta)
    ref, mag = _oracle(x.double().cpu(), w.cpu(), LoraDelta([t.cpu() for t in delta.a], [t.cpu() for t in delta.b],
                                                           delta.scale))  # fmt: skip
    assert_within(y.cpu(), ref, 2.0**-7 * (mag + ref.abs()))
    assert torch.equal(gemv.gemv(x, wk, torch.empty_like(y), _MMA, _tickets, True, lora=delta), y)


@gpu
def test_gpu_misaligned_or_strided_activations():
    """Rows off a 16-byte boundary take the tile kernels; aligned strided rows the mma kernel: both right."""
    packed, w = random_weight("int4", (256, 1024), seed=3, device="cuda")
    wk = resolve("int4", packed, stacked=False)
    buf = torch.randn(4, 1024 + 8, device="cuda", dtype=torch.bfloat16)
    for x in (buf[:1, 1:1025], buf[:, 1:1025], buf[:, 8:]):  # 2 bytes off; rows 2 bytes off; 16-byte aligned rows
        y = gemv.gemv(x, wk, torch.empty((x.shape[0], 256), dtype=x.dtype, device="cuda"), _MMA, _tickets, True)
        ref = x.double() @ w.T
        assert_within(y, ref, matmul_bound(x, w, ref, 2.0**-8))


@gpu
def test_gpu_timeline_stamps_change_no_result():
    from orbit_lightning.kernels.timeline import CYCLES, ENTRY_NS, EXIT_NS, SLOTS

    packed, _ = random_weight("int4", (1024, 4096), seed=9, device="cuda")
    w = resolve("int4", packed, stacked=False)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    plain = gemv.gemv(x, w, torch.empty((1, 1024), device="cuda", dtype=x.dtype), _MMA, _tickets, True)
    stamps = torch.zeros((4096, SLOTS), dtype=torch.int64, device="cuda")
    assert torch.equal(gemv.gemv(x, w, torch.empty_like(plain), _MMA, _tickets, True, stamps=stamps), plain)
    rows = stamps[stamps[:, ENTRY_NS] > 0]
    assert rows.shape[0] == 1024 // _MMA.block_n and (rows[:, EXIT_NS] >= rows[:, ENTRY_NS]).all()
    assert (rows[:, CYCLES + 2] >= rows[:, CYCLES + 1]).all()  # the loop ends after the PDL wait


def _direct_store_matches_tiles(device, monkeypatch):
    """Outputs stored straight from the cross-warp sums (configs.MMA_DIRECT_STORE, shipped) equal the tile epilogue's
    (the LoRA path's) bit for bit, and nothing past M is written (a NaN-filled output)."""
    cfg = GemvConfig(16, 32, 128, mma=True, num_warps=2)  # two row tiles, two warps summed
    packed, _ = random_weight("int4", (96, 512), seed=5, device=device)
    wk = resolve("int4", packed, stacked=False)
    tickets = _tickets if device == "cuda" else _cpu_tickets
    for m in (1, 5, 9, 16):  # one n8 tile (full or partial), two (partial or full)
        x = torch.randn(m, 512, device=device).bfloat16()
        outs = {}
        for direct in (True, False):
            monkeypatch.setattr(configs, "MMA_DIRECT_STORE", direct)
            y = torch.full((m + 1, 96), float("nan"), dtype=torch.bfloat16, device=device)
            gemv.gemv(x, wk, y[:m], cfg, tickets, True)
            assert y[m].isnan().all() and not y[:m].isnan().any(), (m, direct)
            outs[direct] = y[:m]
        assert torch.equal(outs[True], outs[False]), m


@pytest.mark.usefixtures("cpu_kernels")
def test_direct_store_gives_the_tile_epilogues_bits(monkeypatch):
    _direct_store_matches_tiles("cpu", monkeypatch)


@gpu
def test_gpu_direct_store_gives_the_tile_epilogues_bits(monkeypatch):
    _direct_store_matches_tiles("cuda", monkeypatch)
