"""The warpgroup-MMA int4 GEMM (kernels/wgmma_int4.py) against bf16 cuBLAS and the dispatch without it, on the GPU:

    python bench/wgmma_sweep.py [--m 16 32 64] [--programs 2 3 4] [--registers 80] [--tiles ship t128 ...]
                                [--l2-flush read]

For the 12 dense shapes of bench/kernels.py at each M: bf16 cuBLAS, the dispatch with configs.WGMMA_INT4 off ("tile":
the tile kernel, or the decode GEMVs at M <= 16), from 65 rows also the one-pass dequantize + cuBLAS ("dq", what
quant/dispatch.py runs above FUSED_MAX_ROWS), and the wgmma kernel called directly for each tile of --tiles (TILES
below; "ship": the tile dense_gemm picks for M), register cap per thread (r80: 80; "ship": the tile's own or
wgmma_int4.max_registers) and K-split target per SM (p2: wgmma_int4.PROGRAMS_PER_SM = 2, what ships; p0: one
full wave of resident programs). graph_us in microseconds up to M = 1024, do_bench medians above; ratios are
bf16 time / kernel time, geomean over the shapes; errors are max |y - fp32 reference| over max |reference|. Behind
bench/RESULTS.md's wgmma tables (twelfth to eighteenth sessions).
"""
import argparse
import dataclasses
import importlib.util
import math
import os

import torch
import torch.nn.functional as F
from orbit_lightning.kernels import configs
from orbit_lightning.kernels import wgmma_int4 as wg
from orbit_lightning.kernels.formats import resolve
from orbit_lightning.kernels.gemm import _tickets

from orbit_lightning import kernels
from orbit_lightning.quant.formats import get_format

spec = importlib.util.spec_from_file_location("bk", os.path.join(os.path.dirname(__file__), "kernels.py"))
bk = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bk)
SHIPPED = wg.max_registers, wg.PROGRAMS_PER_SM, wg.MIN_ROWS, wg.MAX_ROWS
# Candidate tiles for the rollout's larger decode batches (65-2048 rows), by name; None: what dense_gemm ships for M.
TILES = {
    "ship": None,
    "d64": dataclasses.replace(wg.DECODE, bm=64),  # the decode tile over 64-row activation tiles, K split
    "w128": wg.Tile(warps=4, bm=128, bk=64, stages=4, regs=168),  # one warpgroup, wgmma n128, K split
    "w128k128": wg.Tile(warps=4, bm=128, bk=128, stages=3, regs=168),
    "t128": wg.Tile(warps=8, bm=128, bk=64, stages=4, regs=168, halves=True, parts=2),  # two warpgroups, no split
    "t128s": wg.Tile(warps=8, bm=128, bk=64, stages=4, regs=168),  # two warpgroups in lockstep, K split
    "t64": wg.Tile(warps=8, bm=64, bk=64, stages=4, regs=168, halves=True, parts=2),  # two warpgroups on 64 rows
    "train": wg.TRAIN,
    "train-s": dataclasses.replace(wg.TRAIN, halves=False, parts=1),  # 256 rows, K split
    "s6": dataclasses.replace(wg.DECODE, stages=6),  # deeper rings: more weight bytes in flight per program
    "s8": dataclasses.replace(wg.DECODE, stages=8),
}


def direct(x, pw, n: int, regs: int | None, programs: int, tile: wg.Tile | None = None) -> torch.Tensor:
    """The wgmma kernel on x (bypassing the dispatch) with `tile` (None: the shipped choice for x's rows) at `regs`
    registers per thread (None: the tile's or the shipped choice) and `programs` per SM."""
    tile = tile or wg.pick_tile(x.shape[0], n, configs.sm_count(x.device))
    if regs is not None:
        wg.max_registers = lambda bm, group: regs
        tile = dataclasses.replace(tile, regs=0)
    wg.PROGRAMS_PER_SM, wg.MIN_ROWS, wg.MAX_ROWS = programs, 1, 1 << 30
    out = torch.empty(x.shape[0], n, dtype=torch.bfloat16, device="cuda")
    try:
        return wg.wgmma_int4(x, pw, out, lambda c: _tickets(x.device, c), tile)
    finally:
        wg.max_registers, wg.PROGRAMS_PER_SM, wg.MIN_ROWS, wg.MAX_ROWS = SHIPPED


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--programs", type=int, nargs="+", default=[wg.PROGRAMS_PER_SM], help="K-split targets per SM")
    ap.add_argument("--registers", type=int, nargs="+", default=[0], help="register caps; 0: the shipped choice")
    ap.add_argument("--tiles", nargs="+", default=["ship"], choices=sorted(TILES))
    ap.add_argument("--l2-flush", choices=bk.FLUSH_MODES, default=bk.FLUSH_MODE)
    args = ap.parse_args()
    bk.FLUSH_MODE = args.l2_flush
    print(f"L2 flush: {bk.FLUSH_MODE}")
    fmt = get_format("int4")
    ratios: dict[tuple[int, str], list[float]] = {}
    for model, layers in bk.DENSE.items():
        for layer, n, k in layers:
            w = bk.randn(n, k, scale=0.02)
            packed = fmt.random_packed((n, k), device="cuda")
            pw = resolve("int4", packed, stacked=False, group_size=32)
            ref_w = kernels.dequantize("int4", packed, torch.float32)
            for m in args.m:
                # (graph_us through the decode batches the engine replays as CUDA graphs; do_bench above)
                timer = bk.graph_us if m <= 1024 else bk.us
                x = bk.randn(m, k)
                ref = x.float() @ ref_w.T
                t = {"bf16": timer(F.linear, x, w)}
                configs.WGMMA_INT4 = False
                t["tile"] = timer(kernels.int4_linear, x, packed)
                configs.WGMMA_INT4 = True
                if m > 64:
                    t["dq"] = timer(bk.dq_linear, x, packed)
                errs = []
                for tile_name in args.tiles:
                    for regs in args.registers:
                        for programs in args.programs:
                            name = f"{tile_name}{'' if not regs else f'-r{regs}'}-p{programs}"
                            call = (x, pw, n, regs or None, programs, TILES[tile_name])
                            try:
                                y = direct(*call)
                            except Exception as e:  # a candidate tile that does not launch: say so, go on
                                print(f"FAILED {name} {model}.{layer} M={m}: {type(e).__name__}: {str(e)[:200]}")
                                continue
                            err = (y.float() - ref).abs().max().item() / ref.abs().max().item()
                            errs.append(f"{err:.1e}")
                            if err < 4 * 2**-8:  # else WRONG: no time
                                t[name] = timer(direct, *call)
                            else:
                                print(f"WRONG {name} {model}.{layer} M={m}: {err:.2e}")
                for name, v in t.items():
                    ratios.setdefault((m, name), []).append(t["bf16"] / v)
                print(f"{model:16} {layer:12} {n:6} {k:6} {m:4} | " + " ".join(f"{a} {v:6.1f}" for a, v in t.items())
                      + f" | err {' '.join(errs)}", flush=True)  # fmt: skip
            del w, packed, ref_w
            torch.cuda.empty_cache()
    for m in args.m:
        print(f"-- M={m}: geomean x over bf16: " + "; ".join(
            f"{name} {math.exp(sum(map(math.log, v)) / len(v)):.2f} (min {min(v):.2f}, n={len(v)})"
            for (mm, name), v in sorted(ratios.items()) if mm == m))  # fmt: skip


if __name__ == "__main__":
    main()
