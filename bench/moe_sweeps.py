"""MoE measurements behind choices in the code, on the Qwen3-30B-A3B layer (H200 numbers in bench/RESULTS.md).

    python bench/moe_sweeps.py [--sections tiles mma carveout sort]

- tiles: the fused grouped kernel's tile configs at decode sizes (1-64 tokens, top-8 of 128 experts), gate and
  down, each against the shipped config (`kernels.configs`, "grouped_fwd"), timed by graph_us (cold L2, no host).
  Every variant's output is checked against the shipped one's.
- mma: the decode kernel on mma (kernels/grouped_mma.py) against the tile kernel at 1-512 tokens, each of its
  configs and what the dispatch picks: where it stops paying sets `configs.GROUPED_MMA_ROWS`.
- carveout: whether dequantizing the next projection on a side stream hides under torch's grouped GEMM when the GEMM
  leaves C SMs free (`torch._C._set_sm_carveout_experimental`): the GEMM alone, and GEMM || dequantize, per C.
- sort: kernels.sort_by_expert against torch's argsort + inverse + offsets at 8-4096 pairs, past the kernel's
  MAX_ROWS, which this measurement sets (models.moe hands larger batches to torch).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from dataclasses import replace
from functools import partial

import torch
from orbit_lightning.kernels import configs
from orbit_lightning.kernels.formats import resolve
from orbit_lightning.kernels.grouped_mma import grouped_mma

from orbit_lightning import kernels
from orbit_lightning.models.moe import _expert_offsets, _inverse_permutation
from orbit_lightning.quant.experts import QuantExperts

_spec = importlib.util.spec_from_file_location("moe_paths", os.path.join(os.path.dirname(__file__), "moe_paths.py"))
mp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mp)
bk = mp.bk  # bench/kernels.py: graph_us
EXPERTS, TOP_K, HIDDEN, INTER = mp.EXPERTS, mp.TOP_K, mp.HIDDEN, mp.INTER  # Qwen3-30B-A3B
PROJECTIONS = {"gate": (HIDDEN, INTER), "down": (INTER, HIDDEN)}  # (K, N)


def _experts(k: int, n: int) -> dict[str, torch.Tensor]:
    """Packed int4 experts [E, n, k] (as QuantExperts' gate_proj holds them)."""
    experts = QuantExperts(EXPERTS, k, n, "int4").cuda()
    experts.random_init(torch.Generator("cuda").manual_seed(0))
    return experts.packed("gate_proj")


def section_tiles() -> None:
    print("== fused grouped kernel, decode tiles: us (graph_us, cold L2); best four, and the shipped config ==")
    for name, (k, n) in PROJECTIONS.items():
        packed = _experts(k, n)
        per_expert = sum(v.numel() * v.element_size() for v in packed.values()) / EXPERTS
        for tokens in (1, 4, 16, 64):
            x, offsets = _routed(tokens, k)
            tile = _tile_config(x)  # (the tile kernel's shipped config: without one, decode sizes take grouped_mma)
            shipped = kernels.grouped_dequant_linear(x, offsets, "int4", packed, config=tile)
            times = {"shipped": bk.graph_us(kernels.grouped_dequant_linear, x, offsets, "int4", packed, config=tile)}
            for bm in (16, 32) if tokens >= 16 else (16,):
                for bp in (16, 32, 64):
                    for br in (128, 256, 512):
                        for warps in (2, 4):
                            cfg = kernels.TileConfig(bm, bp, br, num_warps=warps, num_stages=4, swap_ab=True)
                            y = kernels.grouped_dequant_linear(x, offsets, "int4", packed, config=cfg)
                            # other tiles sum K in another order: fp32 rounding, far below bf16's output rounding
                            torch.testing.assert_close(y, shipped, rtol=2**-7, atol=1e-3)
                            times[f"m{bm} p{bp} r{br} w{warps}"] = bk.graph_us(
                                kernels.grouped_dequant_linear, x, offsets, "int4", packed, config=cfg)
            best = sorted((t, label) for label, t in times.items())[:4]
            active = int((offsets.diff() > 0).sum())
            print(f"{name} tokens {tokens:3d} ({active:3d} experts): shipped {times['shipped']:.1f} us; best "
                  + ", ".join(f"{label} {t:.1f}" for t, label in best)
                  + f" ({active * per_expert / best[0][0] / 1e3:.0f} GB/s)", flush=True)


def _tile_config(x: torch.Tensor) -> kernels.TileConfig:
    return configs.pick_config("grouped_fwd", -(-x.shape[0] // EXPERTS), x.device, x.dtype)


def _routed(tokens: int, k: int):
    """Sorted rows x [tokens * TOP_K, k] and int32 expert offsets of a top-8 routing (the same in every run)."""
    gen = torch.Generator("cuda").manual_seed(tokens)
    ids = torch.rand(tokens, EXPERTS, device="cuda", generator=gen).topk(TOP_K, dim=-1).indices.reshape(-1)
    counts = torch.bincount(ids, minlength=EXPERTS)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
    return torch.randn(tokens * TOP_K, k, device="cuda", dtype=torch.bfloat16), offsets


def section_mma() -> None:
    print("== MoE decode: grouped_mma.py against the tile kernel, us (graph_us, cold L2) ==")
    variants = {"wide": configs._GROUPED_MMA, "narrow": configs._GROUPED_MMA_NARROW[0],
                "narrow u1": configs._GROUPED_MMA_NARROW[1], "wide w8": replace(configs._GROUPED_MMA, num_warps=8),
                "narrow w8": replace(configs._GROUPED_MMA_NARROW[0], num_warps=8)}
    for name, (k, n) in PROJECTIONS.items():
        packed = _experts(k, n)
        w = resolve("int4", packed, stacked=True)
        for tokens in (1, 4, 16, 64, 128, 256, 512):
            x, offsets = _routed(tokens, k)
            tile = _tile_config(x)
            ref = kernels.grouped_dequant_linear(x, offsets, "int4", packed, config=tile)
            times = {"tile": bk.graph_us(kernels.grouped_dequant_linear, x, offsets, "int4", packed, config=tile)}
            for label, cfg in variants.items():
                if configs.mma_ok(w, cfg, stacked=True):
                    # the same bf16 weights, K summed in another order: fp32 rounding, below bf16's output rounding
                    torch.testing.assert_close(grouped_mma(x, offsets, w, cfg), ref, rtol=2**-7, atol=1e-3)
                    times[label] = bk.graph_us(grouped_mma, x, offsets, w, cfg)
            picked = configs.pick_grouped_mma(x, w)
            pick = next((label for label, cfg in variants.items() if cfg == picked), "tile")
            print(f"{name} tokens {tokens:3d}: " + ", ".join(f"{label} {t:.1f}" for label, t in times.items())
                  + f" | dispatch: {pick} ({times['tile'] / times[pick]:.2f}x the tile kernel)", flush=True)
            if name == "gate" and kernels.grouped_dequant_swiglu(x, offsets, "int4", packed, packed) is not None:
                three = bk.graph_us(_swiglu_unfused, x, offsets, packed)
                one = bk.graph_us(kernels.grouped_dequant_swiglu, x, offsets, "int4", packed, packed)
                print(f"  gate, up, silu_mul: three launches {three:.1f} us, one (grouped_dequant_swiglu) {one:.1f} us",
                      flush=True)  # fmt: skip


def _swiglu_unfused(x, offsets, packed):
    """What models.moe runs without the fused kernel (the gate's weights stand in for up's)."""
    gate = kernels.grouped_dequant_linear(x, offsets, "int4", packed)
    return kernels.silu_mul(gate, kernels.grouped_dequant_linear(x, offsets, "int4", packed))


def _event_us(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[reps // 2]


def section_carveout() -> None:
    set_carveout = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if set_carveout is None:
        print("== carveout: this torch has no SM carveout; skipped ==")
        return
    print("== dequantize (side stream) under torch's grouped GEMM with C SMs carved out: us (CUDA events) ==")
    packed = _experts(HIDDEN, INTER)
    w_gate = kernels.dequantize("int4", packed, torch.bfloat16)
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    for tokens in (8192, 16384):
        rows = tokens * TOP_K
        ends = torch.full((EXPERTS,), rows // EXPERTS, dtype=torch.int32, device="cuda").cumsum(0).to(torch.int32)
        x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
        gemm = partial(_carved_gemm, set_carveout, x, w_gate, ends)

        def both(carveout, gemm=gemm):
            y = gemm(carveout)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                w = kernels.dequantize("int4", packed, torch.bfloat16)
            main.wait_stream(side)
            return y, w

        alone = _event_us(partial(gemm, None))
        dq = _event_us(lambda: kernels.dequantize("int4", packed, torch.bfloat16))
        print(f"{tokens} tokens: GEMM {alone:.0f} us, dequantize {dq:.0f} us, serial {alone + dq:.0f} us")
        for carveout in (None, 8, 16, 32):
            g, pair = _event_us(partial(gemm, carveout)), _event_us(partial(both, carveout))
            print(f"  C = {carveout}: GEMM {g:.0f} us, GEMM || dequantize {pair:.0f} us, "
                  f"saved {alone + dq - pair:.0f} us", flush=True)  # fmt: skip


def _carved_gemm(set_carveout, x, w, ends, carveout):
    """torch's grouped GEMM x @ w[e]^T with `carveout` SMs left out (None: all SMs)."""
    set_carveout(carveout)
    try:
        return mp._gmm(x, w, ends, False)
    finally:
        set_carveout(None)


def _torch_sort(ids: torch.Tensor):
    """What models.moe runs without kernels.sort_by_expert: stable argsort, inverse, offsets."""
    order = ids.argsort(stable=True)
    return order, _inverse_permutation(order), _expert_offsets(ids[order], EXPERTS)


def section_sort() -> None:
    print("== routing sort: kernels.sort_by_expert against torch's ops, us (graph_us) ==")
    moe_sort = importlib.import_module("orbit_lightning.kernels.moe_sort")
    shipped, moe_sort.MAX_ROWS = moe_sort.MAX_ROWS, 4096  # (past the shipped limit: where does it stop paying?)
    try:
        for tokens in (1, 64, 256, 512):
            gen = torch.Generator("cuda").manual_seed(tokens)
            ids = torch.rand(tokens, EXPERTS, device="cuda", generator=gen).topk(TOP_K, dim=-1).indices.reshape(-1)
            assert all(torch.equal(a, b) for a, b in zip(kernels.sort_by_expert(ids, EXPERTS), _torch_sort(ids)))
            kernel, ops = bk.graph_us(kernels.sort_by_expert, ids, EXPERTS), bk.graph_us(_torch_sort, ids)
            print(f"{ids.numel():5d} pairs: kernel {kernel:.1f} us, torch's ops {ops:.1f} us", flush=True)
    finally:
        moe_sort.MAX_ROWS = shipped


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sections", nargs="+", default=["tiles", "mma", "carveout", "sort"],
                   choices=["tiles", "mma", "carveout", "sort"])
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/moe_sweeps.py needs a CUDA GPU")
    print(f"GPU {torch.cuda.get_device_name()} | torch {torch.__version__}")
    for section in args.sections:
        {"tiles": section_tiles, "mma": section_mma, "carveout": section_carveout, "sort": section_sort}[section]()


if __name__ == "__main__":
    main()
