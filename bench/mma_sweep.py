"""Sweeps of the mma GEMV (kernels/gemv_mma.py), the decode kernel at 1-16 rows, on the GPU machine.

    python bench/mma_sweep.py [--budget SECONDS]
        [--sections mma,m16mt,shapes,m16u,pairs,pairsab,wide,ab,interleave,tiled]

Each section times variants with bench/gemv_sweep.py's section_gemv (CUDA-graph cold-L2 times, each output checked
against an fp32 reference, geomean x bf16 F.linear over the dense shapes of bench/kernels.py). mma: the kernel's
variants at M = 1 against the tile and TMA configs. m16mt: 9 and 16 rows with 1 or 2 row tiles per warp; shapes: the
shipped configs at 1, 8, 9 and 16 rows against the dispatch; m16u: those at 9 and 16 rows with one or two K tiles a
step. pairs: the word-pair lane layout against the 1-8-row one, and the dispatch with it at 9-16 rows (pairsab: that
A/B alone). wide: the word-pair config that serves 9-16 rows, with one or two K tiles a step, its L2 prefetch hint
and warps per SM. ab: the dispatch with its mma configs' L2 prefetch hint changed, alternating; interleave: with
the warps on alternate K steps (GemvConfig.mma_interleave_k); tiled: the dispatch on int4 weights against the same
weights in int4-tiled's layout (quant/formats/tiled.py). (The
adjacent-nibble decode the thirtieth session measured with wide and ab is at commit cb3ff11; the two accumulator
chains of the thirty-third session, GemvConfig.mma_acc_sets and mma_split_tile with the sets section, at d8e302e;
the next step's loads first, the thirty-sixth session's early section and GemvConfig.mma_early_loads, at 2b1fc3b.)
(These sections were in gemv_sweep.py until the thirtieth session; bench/RESULTS.md's entries before it cite them
there. Its pairsgrid section, the layout at 1-8 rows on small grids, is at commit af41f3c.)
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import time
from dataclasses import replace

import torch
import torch.nn.functional as F
from orbit_lightning.kernels import configs
from orbit_lightning.kernels.configs import GemvConfig
from orbit_lightning.kernels.formats import resolve

from orbit_lightning import kernels
from orbit_lightning.quant.formats import get_format
from orbit_lightning.quant.formats.tiled import tile_packed

_spec = importlib.util.spec_from_file_location("gemv_sweep", os.path.join(os.path.dirname(__file__), "gemv_sweep.py"))
gs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gs)
bk, section_gemv, layer_case, reference = gs.bk, gs.section_gemv, gs.layer_case, gs.reference
graph_us, gm = bk.graph_us, bk.geomean
say = gs.say = bk.Log("mma_sweep.log")  # section_gemv's lines go to this sweep's log


def mma_variants() -> dict[str, GemvConfig]:
    """The per-thread mma kernel (gemv_mma.py) at M = 1: the shipped config and its neighbours (warps per program,
    warps per SM, K tiles per step, the L2 prefetch hint; two row tiles per warp)."""
    out = {f"mma16w{nw}/p{pps}/t{t}/l2{pf}": GemvConfig(16, 16, 128, mma=True, num_warps=nw, programs_per_sm=pps,
                                                       mma_tiles=t, l2_prefetch=pf)
           for nw, pps, t, pf in ((8, 24, 2, 128), (8, 16, 2, 128), (8, 24, 2, 0), (16, 16, 2, 128),
                                  (8, 24, 1, 128), (8, 24, 4, 128), (8, 32, 2, 128), (8, 8, 2, 128),
                                  (8, 12, 2, 128), (4, 24, 2, 128), (2, 24, 2, 128), (4, 24, 4, 128))}  # fmt: skip
    out["mma32w8/p16/t2"] = GemvConfig(16, 32, 128, mma=True, num_warps=8, programs_per_sm=16, mma_tiles=2)
    return out


def section_mma(deadline: float) -> None:
    """The mma kernel's variants against the shipped tile configs: M = 1 (and TMA), 4, 8 and 16."""
    shipped = {"split/shipped": configs.GEMV_ONE_ROW, "tma/shipped": configs._GEMV_TALL}
    rows = {f"mma16w{nw}/p{pps}/t{t}": GemvConfig(16, 16, 128, mma=True, num_warps=nw, programs_per_sm=pps,
                                                  mma_tiles=t, l2_prefetch=128)
            for nw, pps, t in ((8, 24, 2), (8, 16, 1), (16, 16, 2), (4, 24, 2), (8, 12, 1))}  # fmt: skip
    rows["mma32w8/p16/t2"] = GemvConfig(16, 32, 128, mma=True, num_warps=8, programs_per_sm=16, mma_tiles=2)
    split = {m: {"split/shipped": next(c for b, c in configs.GEMV_TILES if m <= b)} for m in (4, 8, 16)}
    variants = {1: {**mma_variants(), **shipped}, **{m: {**rows, **split[m]} for m in (4, 8, 16)}}
    section_gemv(deadline, variants, models=("Qwen3-8B", "Qwen3-30B-A3B", "DeepSeek-V3"))


def section_m16mt(deadline: float) -> None:
    """9 and 16 rows on the mma GEMV with 1 or 2 row tiles per warp (block_n 16 / 32: 4 or 2 activation bytes loaded
    per weight byte), warps per program and per SM, against the dispatched kernel (wgmma_int4) in the same run. (Four
    row tiles, block_n 64, lost on every shape: bench/RESULTS.md, twenty-third session.)"""
    variants = {f"mma{bn}w{nw}/p{pps}": GemvConfig(16, bn, 128, mma=True, num_warps=nw, programs_per_sm=pps,
                                                   l2_prefetch=128)
                for bn in (16, 32) for nw in (4, 8, 16) for pps in (8, 16, 24)}  # fmt: skip
    section_gemv(deadline, {9: variants, 16: variants}, dispatched=True)


def section_shapes(deadline: float) -> None:
    """The mma GEMV's shipped configs at 1, 8, 9 and 16 rows against the dispatch in the same run: the data behind
    configs.pick_gemv's choice by rows and weight shape (one or two row tiles a warp; the mma GEMV or wgmma_int4 at
    9-16 rows). Row warps and four row tiles a warp, tried in the twenty-third to twenty-fifth sessions, lost
    everywhere (bench/RESULTS.md)."""
    variants = {"one-rowtile": configs._GEMV_MMA, "two-rowtiles": configs._GEMV_MMA_TWO_ROWTILES,
                "long-k": configs._GEMV_MMA_LONG_K}
    section_gemv(deadline, {m: variants for m in (1, 8, 9, 16)}, dispatched=True)


def section_m16u(deadline: float) -> None:
    """9 and 16 rows on the mma GEMV's shipped configs with one or two K tiles a step (configs.MMA_WIDE_TILES), against
    the dispatch in the same run: the loop that issues the next step's loads after this step's products (sm_90
    ptxas: 128 registers at one row tile and two K tiles, 166 at two row tiles)."""
    variants = {f"{name}/u{u}": replace(cfg, mma_tiles=u)
                for name, cfg in (("one-rowtile", configs._GEMV_MMA), ("two-rowtiles", configs._GEMV_MMA_TWO_ROWTILES),
                                  ("long-k", configs._GEMV_MMA_LONG_K)) for u in (1, 2)}  # fmt: skip
    section_gemv(deadline, {m: variants for m in (9, 16)}, dispatched=True)


def section_pairs(deadline: float) -> None:
    """The word-pair lane layout (GemvConfig.mma_word_pairs: half the activation L1 wavefronts, twice the weights')
    against the 1-8-row one, on the mma configs as they serve 1, 8 and 16 rows (at 16 also two K tiles a step),
    against the dispatch in the same run; then the dispatch at 9-16 rows against one without the layout, three
    alternating rounds, median us."""
    base = {"one-rowtile": configs._GEMV_MMA, "two-rowtiles": configs._GEMV_MMA_TWO_ROWTILES,
            "long-k": configs._GEMV_MMA_LONG_K}  # fmt: skip
    variants: dict[int, dict[str, GemvConfig]] = {}
    for m in (1, 8, 16):
        cfgs = {name: replace(cfg, mma_tiles=min(cfg.mma_tiles, configs.MMA_WIDE_TILES)) if m > configs.MMA_MAX_M
                else cfg for name, cfg in base.items()}  # fmt: skip
        if m > configs.MMA_MAX_M:
            cfgs["one-rowtile/u2"] = configs._GEMV_MMA
        variants[m] = {f"{name}/{layout}": replace(cfg, mma_word_pairs=layout == "pairs")
                       for name, cfg in cfgs.items() for layout in ("words", "pairs")}  # fmt: skip
    section_gemv(deadline, variants, dispatched=True)
    section_pairs_dispatch(deadline)


def alternating_medians(runs: dict, ref: torch.Tensor, bound: torch.Tensor, rounds: int = 3) -> dict[str, float]:
    """Median graph_us of each of `runs` (name: a no-argument callable returning its output, checked against the fp32
    reference within bound), timed in `rounds` alternating rounds in one process, so that the variants share the
    GPU's state; the order's own bias (a few percent on the smallest shapes: bench/RESULTS.md) remains."""
    t: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            assert ((fn().float() - ref).abs() <= bound).all(), name
            t[name].append(graph_us(fn))
    return {name: sorted(v)[len(v) // 2] for name, v in t.items()}


@contextlib.contextmanager
def _configs_set(**switches):
    """The dispatch's module-level switches in kernels.configs set to these values, the shipped ones restored after."""
    shipped = {name: getattr(configs, name) for name in switches}
    for name, value in switches.items():
        setattr(configs, name, value)
    try:
        yield
    finally:
        for name, value in shipped.items():
            setattr(configs, name, value)


def _with_rules(start: int, max_n: int, x: torch.Tensor, packed) -> torch.Tensor:
    """kernels.int4_linear dispatched with configs.MMA_WORD_PAIRS_FROM and MMA_WIDE_MAX_N set to these values."""
    with _configs_set(MMA_WORD_PAIRS_FROM=start, MMA_WIDE_MAX_N=max_n):
        return kernels.int4_linear(x, packed)


def section_pairs_dispatch(deadline: float) -> None:
    """The dispatch at 9-16 rows as shipped against one without the word-pair layout (section_pairs' second half)."""
    say("\n== the dispatch at 9-16 rows, graph_us us (median of 3 alternating rounds): shipped; words (the mma GEMV in "
        "its 1-8-row layout, on small weights only: MMA_WORD_PAIRS_FROM 17, MMA_WIDE_MAX_N 0) ==")
    fmt = get_format("int4")
    rules = {"shipped": (configs.MMA_WORD_PAIRS_FROM, configs.MMA_WIDE_MAX_N), "words": (17, 0)}
    ratios: dict[tuple[int, str], list[float]] = {}
    for model, layers in bk.DENSE.items():
        for layer, n, k in layers:
            if time.time() > deadline:
                return
            packed, w, wdq, wbf = layer_case(fmt, n, k)
            for m in (9, 16):
                x = torch.randn(m, k, device="cuda").bfloat16()
                runs = {r: functools.partial(_with_rules, *rule, x, packed) for r, rule in rules.items()}
                med = alternating_medians(runs, *reference(x, wdq))
                b16 = graph_us(F.linear, x, wbf)
                for r in rules:
                    ratios.setdefault((m, r), []).append(b16 / med[r])
                say(f"{model}.{layer:12} {n:6} {k:6} M={m:2} | bf16 {b16:6.1f} | " + " ".join(
                    f"{r} {v:6.2f}" for r, v in med.items()))
            del wdq, wbf
            torch.cuda.empty_cache()
    say("geomean x bf16: " + ", ".join(f"M={m} {r} {gm(v):.3f}" for (m, r), v in ratios.items()))


def section_wide(deadline: float) -> None:
    """The config that serves 9-16 rows (one row tile a warp, word pairs) with one or two K tiles a step, the weight
    loads' L2 prefetch hint (0, 128, 256 bytes) and 16, 24 or 32 warps per SM, against the dispatch in the same run.
    The twenty-seventh session measured two K tiles a step at 9-16 rows before the word-pair layout existed."""
    base = replace(configs._GEMV_MMA, mma_word_pairs=True)
    variants = {f"u{u}/l2{pf}/p{pps}": replace(base, mma_tiles=u, l2_prefetch=pf, programs_per_sm=pps)
                for u, pf, pps in ((1, 0, 24), (2, 0, 24), (1, 128, 24), (2, 128, 24), (1, 256, 24), (1, 0, 16),
                                   (1, 0, 32), (2, 0, 16))}  # fmt: skip
    section_gemv(deadline, {m: variants for m in (9, 16)}, dispatched=True)


def section_ab(deadline: float) -> None:
    """The dispatch at 1, 8, 9 and 16 rows against itself with the mma GEMV's configs' L2 prefetch hint on the weight
    loads set to 0 and to 128 bytes."""
    _dispatch_ab(deadline, {"shipped": {}, "l2-0": dict(l2_prefetch=0), "l2-128": dict(l2_prefetch=128)},
                 (1, 8, 9, 16))


def section_interleave(deadline: float) -> None:
    """The dispatch at 1, 9 and 16 rows against itself with GemvConfig.mma_interleave_k (the program's warps on
    alternate K steps: one stretch of each row read at a time, not one per warp far apart)."""
    _dispatch_ab(deadline, {"shipped": {}, "interleave": dict(mma_interleave_k=True)}, (1, 9, 16))


def section_tiled(deadline: float) -> None:
    """The dispatch on int4 weights against the same weights in int4-tiled's layout (quant/formats/tiled.py: a warp's
    step reads one contiguous stretch of 1024 bytes a row tile and K tile, not 64 bytes of each of 16 rows a row
    apart), at 1 and 16 rows. Tiled, the mma GEMV also takes the 16-row tall weights the row-major dispatch gives
    wgmma_int4; each output is checked against fp32 (the mma GEMV sums other sets of a word's values per mma on
    int4-tiled's nibble order, so the layouts' bits differ there). tiled-wg: int4-tiled with configs.MMA_TILED_ALL_N
    off, the tall weights' 9-16 rows on wgmma_int4 (which reads the tiled layout too) as the row-major dispatch sends
    them; tiled-wgall: every weight's 9-16 rows there (configs.MMA_SHAPE_DISPATCH off too). wgmma_int4 keeps its
    weight bytes in flight in a TMA ring rather than in registers, so where a GPU reads faster per SM (the H200) it
    may scale where the mma GEMV does not."""

    def on_wgmma(x, tiled, every_weight: bool):
        with _configs_set(MMA_TILED_ALL_N=False, MMA_SHAPE_DISPATCH=not every_weight):
            return kernels.dequant_linear(x, "int4-tiled", tiled)

    def variants(x, packed, w):
        tiled = tile_packed(packed)
        cfg, cfg_t = (configs.pick_gemv(x.shape[0], x.device, x.dtype, True, v)
                      for v in (w, resolve("int4-tiled", tiled, stacked=False)))  # fmt: skip
        runs = {"int4": functools.partial(kernels.dequant_linear, x, "int4", packed),
                "int4-tiled": functools.partial(kernels.dequant_linear, x, "int4-tiled", tiled),
                "tiled-wg": functools.partial(on_wgmma, x, tiled, False),
                "tiled-wgall": functools.partial(on_wgmma, x, tiled, True)}
        w_t = resolve("int4-tiled", tiled, stacked=False)
        for name, change in TILED_NEIGHBOURS.items():  # (where the variant cannot run, the tiled dispatch again)
            v = replace(cfg_t, **change) if cfg_t is not None and cfg_t.mma else None
            runs[name] = (functools.partial(gs.run_gemv, x, w_t, v) if v is not None and configs.mma_ok(w_t, v)
                          else runs["int4-tiled"])  # fmt: skip
        return runs, f"{_kind(cfg):9}/{_kind(cfg_t):9}", ""

    _ab_over_shapes(deadline, "int4 (row-major) against int4-tiled through the dispatch (tiled-wg: tall weights' 9-16 "
                    "rows on wgmma_int4, tiled-wgall: every weight's; " + ", ".join(TILED_NEIGHBOURS)
                    + ": the tiled mma config changed)",
                    ("int4", "int4-tiled", "tiled-wg", "tiled-wgall", *TILED_NEIGHBOURS), (1, 16), variants)


# The tiled mma config's neighbours: a tiled row tile's K tile is one 1024-byte stretch, so the trade-offs measured on
# the row-major layout (one row tile a warp and one K tile a step at 9-16 rows) may not hold. mt2: two row tiles a
# warp (half the activation bytes per weight byte); u2: two K tiles a step (2 KB contiguous a row tile).
TILED_NEIGHBOURS = {"tiled-mt2": dict(block_n=32, programs_per_sm=16), "tiled-u2": dict(mma_tiles=2)}


def _dispatch_ab(deadline: float, variants: dict[str, dict], rows: tuple[int, ...]) -> None:
    """The dispatch at `rows` rows against itself with its mma configs changed by each of `variants` (GemvConfig
    fields). Shapes the mma GEMV does not serve time the dispatch for every variant."""

    def changed(x, packed, w):
        cfg = configs.pick_gemv(x.shape[0], x.device, x.dtype, True, w)
        if cfg is None or not cfg.mma:  # (the dispatch, unchanged, in every variant's place)
            return {name: functools.partial(kernels.int4_linear, x, packed) for name in variants}, _kind(cfg), ""
        runs = {name: functools.partial(gs.run_gemv, x, w, replace(cfg, **change)) for name, change in variants.items()}
        bits = {name: fn() for name, fn in runs.items()}
        same = [name for name in bits if "shipped" in bits and torch.equal(bits[name], bits["shipped"])]
        return runs, _kind(cfg), f" | shipped's bits: {' '.join(same)}" if same else ""

    _ab_over_shapes(deadline, "the dispatch with its mma configs changed: " + " / ".join(variants), tuple(variants),
                    rows, changed)


def _kind(cfg: GemvConfig | None) -> str:
    return f"mma bn{cfg.block_n}" if cfg is not None and cfg.mma else "wgmma"


def _ab_over_shapes(deadline: float, title: str, names: tuple[str, ...], rows: tuple[int, ...], variants) -> None:
    """Per dense shape (bench/kernels.py's 12) and M in `rows`: variants(x, packed, w) gives (runs {name: fn}, a label,
    a note); three alternating rounds of them in one process, median graph_us, each output checked. Per name and M,
    the geomean x bf16 over the shapes."""
    say(f"\n== {title}, graph_us us (median of 3 alternating rounds) ==")
    fmt = get_format("int4")
    speedups: dict[tuple[int, str], list[float]] = {}
    for model, layers in bk.DENSE.items():
        for layer, n, k in layers:
            if time.time() > deadline:
                break
            packed, w, wdq, wbf = layer_case(fmt, n, k)
            for m in rows:
                x = torch.randn(m, k, device="cuda").bfloat16()
                runs, label, note = variants(x, packed, w)
                med = alternating_medians(runs, *reference(x, wdq))
                b16 = graph_us(F.linear, x, wbf)
                for name, v in med.items():
                    speedups.setdefault((m, name), []).append(b16 / v)
                say(f"{model}.{layer:12} {n:6} {k:6} M={m:2} {label} | bf16 {b16:6.1f} | " +
                    " ".join(f"{v:6.2f}" for v in med.values()) + note)
            del wdq, wbf
            torch.cuda.empty_cache()
    for name in names:
        per_m = {m: gm(v) for (m, nm), v in speedups.items() if nm == name}
        both = speedups.get((1, name), []) + speedups.get((16, name), [])
        say(f"geomean x bf16 {name:14}: " + ", ".join(f"M={m} {g:.3f}" for m, g in per_m.items()) +
            (f"; M = 1 and 16 {gm(both):.3f}" if 16 in rows else ""))


def main() -> None:
    sections = {"mma": section_mma, "m16mt": section_m16mt, "shapes": section_shapes, "m16u": section_m16u,
                "pairs": section_pairs, "pairsab": section_pairs_dispatch, "wide": section_wide,
                "ab": section_ab, "interleave": section_interleave, "tiled": section_tiled}
    bk.run_sweep(__doc__, "mma_sweep.py", say, sections, "shapes")


if __name__ == "__main__":
    main()
