"""Sweep of the small-M (decode) kernels on the GPU machine (the one-pass dequantize's: bench/dequant_sweep.py; the
mma GEMV's variants: bench/mma_sweep.py).

    python bench/gemv_sweep.py [--budget SECONDS] [--sections gemv,final,tma,lora,m16x,floor,epilogue,regs]

gemv: GemvConfig variants on the dense layer shapes of bench/kernels.py at M = 1 and 16, CUDA-graph cold-L2 times
(graph_us), each output checked against an fp32 reference; per-variant geomean speedups over bf16 F.linear and the
best variant per shape. final: the short list per M (1, 2, 4, 16), then the winners wired into configs._GEMV for
this process and bench/kernels.py's dense table run with them. tma: the descriptor variants. lora: the decode LoRA
in the GEMV's launch or after it. epilogue: the mma GEMV's direct store against its tile epilogue. floor: small
GEMVs at M = 1 cold and warm, PDL on and off, more warps a program. m16x: the M = 16 kernels with 16 activation rows
and with one row 16 times (stride 0), and M = 1. regs: the mma GEMV with and without a register cap.
"""

from __future__ import annotations

import importlib.util
import os
import time
from dataclasses import replace

import torch
import torch.nn.functional as F
from orbit_lightning.kernels import configs, gemm, gemv, gemv_mma
from orbit_lightning.kernels.configs import GemvConfig
from orbit_lightning.kernels.formats import resolve

from orbit_lightning import kernels
from orbit_lightning.quant.formats import get_format

_spec = importlib.util.spec_from_file_location("bench_kernels", os.path.join(os.path.dirname(__file__), "kernels.py"))
bk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bk)
graph_us, us, packed_bytes = bk.graph_us, bk.us, bk.packed_bytes

say, gm = bk.Log("gemv_sweep.log"), bk.geomean


def dot_variants() -> dict[str, GemvConfig]:
    tiles = {  # name -> (block_n, warps, prefetch, maxnreg)
        "n32": (32, 1, True, None),
        "n32np": (32, 1, False, None),
        "n16": (16, 1, True, None),
        "n64": (64, 1, True, None),
        "n64r168": (64, 1, True, 168),
        "n32r128": (32, 1, True, 128),
        "n128w4": (128, 4, True, None),
    }
    out = {}
    for name, (bn, warps, pf, reg) in tiles.items():
        kw = dict(num_warps=warps, prefetch=pf, maxnreg=reg)
        for it in (2, 4, 8):
            out[f"{name}/k{it}"] = GemvConfig(16, bn, 128, k_iters=it, **kw)
        for pps in (8, 12, 16, 24, 32):
            out[f"{name}/p{pps}"] = GemvConfig(16, bn, 128, programs_per_sm=pps, **kw)
    return out


def fma_variants(bm: int) -> dict[str, GemvConfig]:
    tiles = {"f32w4": (32, 256, 4), "f64w4": (64, 256, 4)}
    out = {}
    for name, (bn, bkk, warps) in tiles.items():
        for it in (4,):
            out[f"{name}/k{it}"] = GemvConfig(bm, bn, bkk, k_iters=it, dot=False, num_warps=warps)
        for pps in (16, 32):
            out[f"{name}/p{pps}"] = GemvConfig(bm, bn, bkk, dot=False, num_warps=warps, programs_per_sm=pps)
    return out


def tma_variants() -> dict[int, dict[str, GemvConfig]]:
    """Descriptor (TMA) variants per M: (block_n, warps, block_k) x pipeline depth x split (programs per
    SM, or k64: no split, the pipeline holding a program's whole K range)."""
    tiles = {1: ((16, 1, 256), (32, 1, 256)), 16: ((32, 1, 256), (64, 2, 256), (64, 2, 128), (128, 4, 128))}
    out: dict[int, dict[str, GemvConfig]] = {1: {}, 16: {}}
    for m, shapes in tiles.items():
        for bn, warps, bkk in shapes:
            for stages in (3, 4, 8):
                for split in ("p4", "p8", "k64"):
                    kw = {"k_iters": 64} if split == "k64" else {"programs_per_sm": int(split[1:])}
                    out[m][f"tma{bn}w{warps}k{bkk}/s{stages}{split}"] = GemvConfig(
                        16, bn, bkk, num_warps=warps, num_stages=stages, tma=True, **kw)
    return out


def tickets(n: int) -> torch.Tensor:
    return gemm._tickets(torch.device("cuda", torch.cuda.current_device()), n)


def run_gemv(x: torch.Tensor, w, cfg: GemvConfig, lora=None) -> torch.Tensor:
    out = torch.empty((x.shape[0], w.n), dtype=x.dtype, device=x.device)
    return gemv.gemv(x, w, out, cfg, tickets, gemm.fast_int4(w, x.dtype), lora)


def layer_case(fmt, n: int, k: int):
    """One random int4 layer: (packed tensors, resolved weight, fp32 dequantized reference, bf16 baseline)."""
    torch.manual_seed(0)
    packed = fmt.random_packed((n, k), device="cuda")
    wbf = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
    return packed, resolve("int4", packed, stacked=False), kernels.dequantize("int4", packed).float(), wbf


def reference(x, wdq):
    """fp32 x @ W^T and the bf16 error bound a kernel's result must stay within (2^-8 of |x||W| + |ref|)."""
    ref = x.float() @ wdq.T
    return ref, 2.0**-8 * (x.float().abs() @ wdq.abs().T + ref.abs())


def section_tma(deadline: float) -> None:
    """The descriptor variants against the shipped configs (configs._GEMV), M = 1 and 16."""
    tma = tma_variants()
    section_gemv(deadline, {m: {**tma[m], **{f"shipped/m{b}": c for b, c in configs._GEMV if b == m}} for m in tma},
                 models=("Qwen3-8B", "Qwen3-30B-A3B", "DeepSeek-V3"))


def section_floor(deadline: float) -> None:
    """Where the small weights' time goes at M = 1: per N x K, bf16 F.linear and the dispatched int4 GEMV with a cold
    L2 (graph_us) and warm (the same graph without the flush, the weights L2-resident), the GEMV with PDL off, and
    mma configs with more warps a program (shorter K runs a warp); an empty kernel (zero_ of 4 bytes) for scale."""
    from orbit_lightning.kernels import pdl

    say("\n== floor: small GEMVs at M = 1, us (cold = graph_us; warm = no flush) ==")
    one = torch.zeros(1, device="cuda")
    say(f"empty kernel: cold {graph_us(one.zero_):.2f} warm {warm_us(one.zero_):.2f}")
    fmt = get_format("int4")
    more_warps = {f"w{nw}/p{pps}/t{t}": replace(configs._GEMV_MMA, num_warps=nw, programs_per_sm=pps, mma_tiles=t)
                  for nw, pps, t in ((16, 32, 2), (16, 48, 1), (16, 64, 1), (8, 48, 1))}  # fmt: skip
    for n, k in ((2048, 512), (2048, 4096), (5120, 2048), (4096, 4096), (6144, 4096)):
        if time.time() > deadline:
            return
        packed, w, wdq, wbf = layer_case(fmt, n, k)
        x = torch.randn(1, k, device="cuda").bfloat16()
        ref, bound = reference(x, wdq)
        cold = {"bf16": graph_us(F.linear, x, wbf), "int4": graph_us(kernels.int4_linear, x, packed)}
        warm = {"bf16": warm_us(F.linear, x, wbf), "int4": warm_us(kernels.int4_linear, x, packed)}
        pdl.ENABLED = False
        try:
            cold["int4 no PDL"] = graph_us(kernels.int4_linear, x, packed)
        finally:
            pdl.ENABLED = True
        for name, cfg in more_warps.items():
            y = run_gemv(x, w, cfg)
            assert ((y.float() - ref).abs() <= bound).all(), name
            cold[name] = graph_us(run_gemv, x, w, cfg)
        say(f"{n:5} x {k:5} ({packed_bytes(packed) / 1e6:5.2f} MB int4) | cold " + ", ".join(
            f"{a} {t:.2f}" for a, t in cold.items()) + " | warm " + ", ".join(f"{a} {t:.2f}" for a, t in warm.items()))
        del wdq, wbf
        torch.cuda.empty_cache()


def warm_us(fn, *args, reps: int = 20) -> float:
    """GPU time of fn(*args) a call, in a CUDA graph of `reps` back-to-back calls (inputs L2-resident after one)."""
    fn(*args)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn(*args)
    return bk.replay_ms(g) * 1e3 / reps


def section_epilogue(deadline: float) -> None:
    """The mma GEMV's epilogue A/B (configs.MMA_DIRECT_STORE): outputs stored straight from the cross-warp sum, or
    assembled into a tile first, at M = 1, 4 and 8 on the 12 dense shapes; graph_us medians over alternating rounds
    (one machine, one process), outputs compared bit for bit."""
    say("\n== mma GEMV epilogue: direct store / tile (configs.MMA_DIRECT_STORE), graph_us, us ==")
    fmt = get_format("int4")
    ratios: dict[int, list[float]] = {}
    for model, layers in bk.DENSE.items():
        for layer, n, k in layers:
            if time.time() > deadline:
                return
            packed, w, wdq, wbf = layer_case(fmt, n, k)
            for m in (1, 4, 8):
                x = torch.randn(m, k, device="cuda").bfloat16()
                t: dict[bool, list[float]] = {True: [], False: []}
                outs = {}
                try:
                    for _ in range(3):
                        for direct in (True, False):
                            configs.MMA_DIRECT_STORE = direct
                            outs[direct] = kernels.int4_linear(x, packed)
                            t[direct].append(graph_us(kernels.int4_linear, x, packed))
                finally:
                    configs.MMA_DIRECT_STORE = True
                d, tile = sorted(t[True])[1], sorted(t[False])[1]
                ratios.setdefault(m, []).append(tile / d)
                say(f"{model}.{layer:12} {n:6} {k:6} M={m} | bf16 {graph_us(F.linear, x, wbf):6.1f} | direct {d:6.2f} "
                    f"tile {tile:6.2f} ({tile / d:.3f}) | equal {torch.equal(outs[True], outs[False])}")
            del wdq, wbf
            torch.cuda.empty_cache()
    say("geomean tile / direct: " + ", ".join(f"M={m} {gm(v):.3f}" for m, v in ratios.items()))


def section_m16x(deadline: float) -> None:
    """Why M = 16 is slow: the shipped M = 16 kernel with 16 distinct activation rows, with one row read 16 times (x
    of stride 0: the same bytes, so L1 / L2 traffic of one row), and M = 1."""
    say("\n== M = 16 activation traffic: graph_us, us ==")
    fmt = get_format("int4")
    cfg16 = next(c for b, c in configs.GEMV_TILES if b == 16)
    mma16 = replace(configs._GEMV_MMA_ONE_TILE, block_n=16)
    for model in ("Qwen3-8B", "DeepSeek-V3"):
        for layer, n, k in bk.DENSE[model]:
            if time.time() > deadline:
                return
            packed, w, wdq, wbf = layer_case(fmt, n, k)
            x16 = torch.randn(16, k, device="cuda").bfloat16()
            x_one = x16[:1].expand(16, k)
            t = {"bf16 M=16": graph_us(F.linear, x16, wbf), "tile M=16": graph_us(run_gemv, x16, w, cfg16),
                 "tile M=16 one row": graph_us(run_gemv, x_one, w, cfg16),
                 "mma M=16": graph_us(run_gemv, x16, w, mma16) if configs.mma_ok(w, mma16) else float("nan"),
                 "mma M=16 one row": graph_us(run_gemv, x_one, w, mma16) if configs.mma_ok(w, mma16) else float("nan"),
                 "mma M=1": graph_us(run_gemv, x16[:1], w, configs.pick_gemv(1, x16.device, x16.dtype, True, w))}
            say(f"{model}.{layer:10} {n:6} {k:6} | " + ", ".join(f"{a} {b:.1f}" for a, b in t.items()))
            del wdq, wbf


def section_gemv(deadline: float, variants_by_m: dict[int, dict[str, GemvConfig]] | None = None,
                 models: tuple[str, ...] = tuple(bk.DENSE), dispatched: bool = False) -> None:
    """dispatched: also time what kernels.int4_linear runs for each M (its own row, "dispatched"), so that the
    variants meet the shipped dispatch in the same run."""
    say("\n== gemv sweep: int4-g32 forward, graph_us (cold L2, no host cost), x = bf16 F.linear us / variant us ==")
    fmt = get_format("int4")
    shapes = [(f"{model}.{layer}", n, k) for model in models for layer, n, k in bk.DENSE[model]]
    if variants_by_m is None:
        dots = dot_variants()
        variants_by_m = {1: {**dots, **fma_variants(1)}, 16: dots}
    ms = sorted(m for m, v in variants_by_m.items() if v)
    tiny = resolve("int4", fmt.random_packed((128, 512), device="cuda"), stacked=False)
    xt = torch.randn(1, 512, device="cuda").bfloat16()
    one = torch.zeros(1, device="cuda")
    say(f"floor: one tiny kernel (zero_ of 4 bytes) {graph_us(one.zero_):.2f} us; gemv 128x512 M=1 no split "
        f"{graph_us(run_gemv, xt, tiny, GemvConfig(16, 32, 128, k_iters=4)):.2f} us, 4 splits "
        f"{graph_us(run_gemv, xt, tiny, GemvConfig(16, 32, 128, k_iters=1)):.2f} us")  # fmt: skip
    rows = []  # (shape, m, variant, us)
    base = {}  # (shape, m) -> (bf16 us, old us, bytes)
    bad = set()
    for name, n, k in shapes:
        if time.time() > deadline:
            say("(budget: gemv sweep cut short)")
            break
        packed, w, wdq, wbf = layer_case(fmt, n, k)
        for m in ms:
            x = torch.randn(m, k, device="cuda").bfloat16()
            ref, bound = reference(x, wdq)
            old_cfg = configs._FAST["fwd"][0][1]
            base[(name, m)] = (graph_us(F.linear, x, wbf),
                               graph_us(kernels.int4_linear, x, packed, config=old_cfg),
                               packed_bytes(packed) + 2 * m * (n + k))  # fmt: skip
            if dispatched:
                rows.append((name, m, "dispatched", graph_us(kernels.int4_linear, x, packed)))
            for vname, cfg in variants_by_m[m].items():
                if vname in bad:
                    continue
                try:
                    y = run_gemv(x, w, cfg)
                    err = ((y.float() - ref).abs() - bound).max().item()
                    if err > 0:
                        say(f"  WRONG {vname} {name} M={m}: exceeds bound by {err:.3e}")
                        bad.add(vname)
                        continue
                    rows.append((name, m, vname, graph_us(run_gemv, x, w, cfg)))
                except Exception as e:  # a config may not compile / fit
                    say(f"  FAILED {vname}: {type(e).__name__}: {str(e)[:200]}")
                    bad.add(vname)
        del wdq, wbf
        torch.cuda.empty_cache()
        done = [r for r in rows if r[0] == name]
        best = {m: min((r for r in done if r[1] == m), key=lambda r: r[3], default=None) for m in ms}
        for m in ms:
            if (name, m) in base and best[m]:
                b16, old, byts = base[(name, m)]
                vname, t = best[m][2], best[m][3]
                say(f"{name:24} {n:6} {k:6} M={m:2} | bf16 {b16:7.1f} old {old:7.1f} ({b16 / old:4.2f}x) | best "
                    f"{vname:14} {t:7.1f} ({b16 / t:4.2f}x, {byts / t / 1e6:4.2f} TB/s)")  # fmt: skip
    if say.file:
        say.file.write("\nall timings (shape, M, variant, us):\n")
        say.file.write("".join(f"{r[0]} {r[1]} {r[2]} {r[3]:.2f}\n" for r in rows))
    for m in ms:
        say(f"\n-- M={m}: variants by geomean speedup over bf16 (min over shapes), top 12 --")
        by_v: dict[str, list[float]] = {}
        for name, mm, vname, t in rows:
            if mm == m:
                by_v.setdefault(vname, []).append(base[(name, m)][0] / t)
        n_shapes = max((len(v) for v in by_v.values()), default=0)
        ranked = sorted(((gm(v), min(v), k) for k, v in by_v.items() if len(v) == n_shapes), reverse=True)
        for g, mn, vname in ranked[:12]:
            say(f"   {vname:16} geomean {g:5.2f}x  min {mn:5.2f}x")
    say("\n-- best variant per shape (oracle) --")
    for m in ms:
        ratios = []
        for (name, mm), (b16, _, _) in base.items():
            cand = [r[3] for r in rows if r[0] == name and r[1] == m]
            if mm == m and cand:
                ratios.append(b16 / min(cand))
        say(f"   M={m}: oracle geomean {gm(ratios):5.2f}x min {min(ratios, default=float('nan')):5.2f}x; old path "
            f"geomean {gm([b / o for (nm, mm), (b, o, _) in base.items() if mm == m]):5.2f}x")  # fmt: skip


def final_candidates() -> dict[int, dict[str, GemvConfig]]:
    """Per M: the variants the final run picks from (the best of the earlier sweeps and their neighbours)."""
    m1 = {}
    for pps in (12, 16, 24):
        m1[f"n16/p{pps}"] = GemvConfig(16, 16, 128, programs_per_sm=pps)
        m1[f"n16two/p{pps}"] = GemvConfig(16, 16, 128, programs_per_sm=pps, two_tiles=True)
        m1[f"n16two-np/p{pps}"] = GemvConfig(16, 16, 128, programs_per_sm=pps, two_tiles=True, prefetch=False)
        m1[f"n32two/p{pps}"] = GemvConfig(16, 32, 128, programs_per_sm=pps, two_tiles=True)
        m1[f"f32w4/p{pps}"] = GemvConfig(1, 32, 256, programs_per_sm=pps, dot=False, num_warps=4)
    m1["f32w4/k4"] = GemvConfig(1, 32, 256, k_iters=4, dot=False, num_warps=4)
    m16 = {}
    for pps in (8, 12, 16):
        m16[f"n32np/p{pps}"] = GemvConfig(16, 32, 128, programs_per_sm=pps, prefetch=False)
        m16[f"n32two-np/p{pps}"] = GemvConfig(16, 32, 128, programs_per_sm=pps, two_tiles=True, prefetch=False)
        m16[f"n16two-np/p{pps}"] = GemvConfig(16, 16, 128, programs_per_sm=pps, two_tiles=True, prefetch=False)
        m16[f"n16/p{pps}"] = GemvConfig(16, 16, 128, programs_per_sm=pps)
    m16["n32np/k4"] = GemvConfig(16, 32, 128, k_iters=4, prefetch=False)
    m2 = {"f32w4x2/k4": GemvConfig(2, 32, 256, k_iters=4, dot=False, num_warps=4),
          "f32w4x2/p16": GemvConfig(2, 32, 256, programs_per_sm=16, dot=False, num_warps=4)}  # fmt: skip
    m4 = {"f32w4x4/k4": GemvConfig(4, 32, 256, k_iters=4, dot=False, num_warps=4),
          "f32w4x4/p16": GemvConfig(4, 32, 256, programs_per_sm=16, dot=False, num_warps=4)}  # fmt: skip
    return {1: m1, 2: m2, 4: m4, 16: m16}


def section_final(deadline: float) -> None:
    """Pick the best candidate per M (geomean over the dense shapes), wire it into configs._GEMV for this
    process, and run bench/kernels.py's dense table with it."""
    say("\n== final: candidates per M, graph_us; x = bf16 F.linear us / variant us ==")
    fmt = get_format("int4")
    shapes = [(f"{model}.{layer}", n, k) for model, layers in bk.DENSE.items() for layer, n, k in layers]
    cands = final_candidates()
    ratios: dict[tuple[int, str], list[float]] = {}
    bad = set()
    for name, n, k in shapes:
        if time.time() > deadline:
            say("(budget: final sweep cut short)")
            break
        packed, w, wdq, wbf = layer_case(fmt, n, k)
        for m, variants in cands.items():
            x = torch.randn(m, k, device="cuda").bfloat16()
            ref, bound = reference(x, wdq)
            b16 = graph_us(F.linear, x, wbf)
            todo = dict(variants)
            if m in (2, 4):  # against the M = 16 DOT candidates
                todo.update({v: c for v, c in cands[16].items() if v.endswith("/p12")})
            for vname, cfg in todo.items():
                if (m, vname) in bad:
                    continue
                try:
                    y = run_gemv(x, w, cfg)
                    if ((y.float() - ref).abs() - bound).max().item() > 0:
                        say(f"  WRONG {vname} {name} M={m}")
                        bad.add((m, vname))
                        continue
                    ratios.setdefault((m, vname), []).append(b16 / graph_us(run_gemv, x, w, cfg))
                except Exception as e:
                    say(f"  FAILED {vname} M={m}: {type(e).__name__}: {str(e)[:200]}")
                    bad.add((m, vname))
        del wdq, wbf
        torch.cuda.empty_cache()
    best = {}
    for m in cands:
        full = max((len(v) for (mm, _), v in ratios.items() if mm == m), default=0)
        ranked = sorted(((gm(v), min(v), name) for (mm, name), v in ratios.items() if mm == m and len(v) == full),
                        reverse=True)  # fmt: skip
        say(f"-- M={m}: " + "  ".join(f"{nm} {g:.2f}x (min {mn:.2f})" for g, mn, nm in ranked[:6]))
        if ranked:
            best[m] = ranked[0][2]
    allc = {v: c for d in cands.values() for v, c in d.items()}
    if 1 in best and 16 in best:
        configs._GEMV = ((1, allc[best[1]]), (16, allc[best[16]]))
        say(f"wired for this run: configs._GEMV = {configs._GEMV!r}")
    rep = bk.Report(100)
    bk.bench_dense(rep)
    bk.summary(rep)


def _gemv_then_lora(x, fmt, packed, delta):
    return kernels.lora_add_many(kernels.dequant_linear(x, fmt, packed), x, *delta)


def section_lora(deadline: float) -> None:
    """Decode LoRA (r = 16) on the engine's Qwen3-8B shapes, Qwen3-30B-A3B's qkv and DeepSeek-V3's q_b at M = 1-16:
    the base GEMV alone, plus the adapters in the small-M kernel's own launch (kernels/gemv_lora.py, the config
    configs.pick_gemv gives), plus `lora_add_many`'s two launches, and what the dispatch runs (configs.fuse_lora
    picks between the first two; at 16 rows on Hopper, wgmma_int4 then lora_add_many)."""
    say("\n== decode LoRA, r = 16: graph_us (cold L2); 'fused' = adapters in the GEMV launch, '+2' = GEMV + "
        "lora_add_many, 'disp' = dispatched ==")
    say("shape              M   base_us  fused_us  +2_us   disp_us   fused-base  +2-base  disp-base")
    fmt = get_format("int4")
    cases = [("qkv", 6144, 4096, (4096, 1024, 1024)), ("o", 4096, 4096, (4096,)),
             ("gate_up", 24576, 4096, (12288, 12288)), ("down", 4096, 12288, (4096,)),
             ("30B-A3B qkv", 5120, 2048, (4096, 512, 512)), ("DSV3 q_b", 24576, 1536, (24576,))]  # fmt: skip
    for name, n, k, ns in cases:
        if time.time() > deadline:
            return
        packed = fmt.random_packed((n, k), device="cuda")
        w = resolve("int4", packed, stacked=False)
        a = [torch.randn(16, k, device="cuda").bfloat16() / k**0.5 for _ in ns]
        b = [torch.randn(ng, 16, device="cuda").bfloat16() for ng in ns]
        delta = kernels.LoraDelta(a, b, [2.0] * len(ns))
        for m in (1, 2, 4, 8, 16):
            x = torch.randn(m, k, device="cuda").bfloat16()
            cfg = configs.pick_gemv(m, x.device, x.dtype, True, w)
            base = graph_us(kernels.dequant_linear, x, fmt, packed)
            fused = graph_us(run_gemv, x, w, cfg, delta)
            two = graph_us(_gemv_then_lora, x, fmt, packed, delta)
            disp = graph_us(kernels.dequant_linear, x, fmt, packed, lora=delta)
            say(f"{name:16s} {m:4d}  {base:8.2f}  {fused:8.2f}  {two:6.2f}  {disp:7.2f}   {fused - base:10.2f}  "
                f"{two - base:7.2f}  {disp - base:9.2f}")


def section_regs(deadline: float) -> None:
    """gemv_mma.py's register cap (GemvConfig.maxnreg) on the dispatched decode configs at M = 1 and 8, with and
    without a fused LoRA (r = 16, one adapter): the cap decides how many 8-warp programs stay resident per SM
    (65,536 registers: 3 at <= 80 per thread, 2 at 81-128), so whether a grid of N / 16 programs runs in one wave."""
    say("\n== mma GEMV register cap: graph_us (cold L2); progs = weight programs, warps each ==")
    say("shape                           M  lora  progs  warps   bf16    shipped   cap80   cap80 x bf16 / shipped x")
    fmt = get_format("int4")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ratios = {False: [], True: []}
    for model in bk.DENSE:
        for layer, n, k in bk.DENSE[model]:
            if time.time() > deadline:
                say("(budget: regs cut short)")
                return
            packed, w, wdq, wbf = layer_case(fmt, n, k)
            a = torch.randn(16, k, device="cuda").bfloat16() / k**0.5
            b = torch.randn(n, 16, device="cuda").bfloat16() * 0.02
            delta = kernels.LoraDelta([a], [b], [2.0])
            for m in (1, 8):
                x = torch.randn(m, k, device="cuda").bfloat16()
                cfg = configs.pick_gemv(m, x.device, x.dtype, True, w)
                if cfg is None or not cfg.mma:
                    continue
                capped = replace(cfg, maxnreg=80)
                ref, bound = reference(x, wdq)
                bf = graph_us(F.linear, x, wbf)
                nw = gemv_mma.warps_for(cfg, n // cfg.block_n, k, sms)
                for lora in (False, True):
                    d = delta if lora else None
                    want = ref + 2.0 * (x.float() @ a.float().T) @ b.float().T if lora else ref
                    times = []
                    for c in (cfg, capped):
                        y = run_gemv(x, w, c, d)
                        err = ((y.float() - want).abs() - bound - 2.0**-8 * want.abs()).max().item()
                        if err > 0:
                            say(f"  WRONG {model}.{layer} M={m} lora={lora} maxnreg={c.maxnreg}: {err:.3e}")
                        times.append(graph_us(run_gemv, x, w, c, d))
                    ratios[lora].append(times[0] / times[1])
                    say(f"{model + '.' + layer:30s} {m:2d}  {int(lora):4d}  {n // cfg.block_n:5d}  {nw:5d}  {bf:6.1f}"
                        f"  {times[0]:8.2f}  {times[1]:6.2f}   {bf / times[1]:5.2f} / {bf / times[0]:5.2f}")
            del wdq, wbf
            torch.cuda.empty_cache()
    for lora, r in ratios.items():
        say(f"geomean shipped / cap80 time, lora={int(lora)}: {gm(r):.3f} over {len(r)} cases")


def main() -> None:
    sections = {"gemv": section_gemv, "tma": section_tma, "final": section_final, "lora": section_lora,
                "m16x": section_m16x, "floor": section_floor, "epilogue": section_epilogue, "regs": section_regs}
    bk.run_sweep(__doc__, "gemv_sweep.py", say, sections, "gemv")


if __name__ == "__main__":
    main()
