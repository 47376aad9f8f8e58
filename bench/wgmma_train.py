"""The warpgroup-MMA int4 GEMM at training sizes (kernels/wgmma_int4.py, Tile TRAIN), on the GPU:

    python bench/wgmma_train.py [--sections dense,moe] [--m 4096 16384] [--tokens 8192 16384 32768]

dense: the 12 shapes of bench/kernels.py, forward y = x W^T: bf16 cuBLAS (F.linear), one-pass dequantize + cuBLAS
("dq": what quant/dispatch.py runs for many rows) and the fused kernel ("wg"), which reads only the packed bytes.
moe: bench/kernels.py's MoE projections, forward over experts sorted by token: bf16 torch grouped_mm, the model's
chunked path (dequantize the chunk's experts + grouped_mm) and wgmma_int4_grouped on device offsets. Times are
do_bench medians in microseconds; ratios are bf16 time / path time; errors are max |y - reference| / max |reference|
against the same product on the decoded bf16 weights.
"""

import argparse
import dataclasses
import importlib.util
import math
import os

import torch
import torch.nn.functional as F
from orbit_lightning.kernels import wgmma_int4 as wg
from orbit_lightning.kernels.formats import resolve
from orbit_lightning.kernels.gemm import _tickets

from orbit_lightning import kernels
from orbit_lightning.quant.experts import QuantExperts
from orbit_lightning.quant.formats import get_format

spec = importlib.util.spec_from_file_location("bk", os.path.join(os.path.dirname(__file__), "kernels.py"))
bk = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bk)


def _err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return (y.float() - ref.float()).abs().max().item() / ref.float().abs().max().item()


def _geomean(v: list[float]) -> str:
    return f"{math.exp(sum(map(math.log, v)) / len(v)):.3f} (min {min(v):.2f}, n={len(v)})"


TILES = {"wg": wg.TRAIN, "wg-h": dataclasses.replace(wg.TRAIN, halves=not wg.TRAIN.halves)}


def tickets(count: int) -> torch.Tensor:
    return _tickets(torch.device("cuda", torch.cuda.current_device()), count)


def _row(ratios: dict, size: int, t: dict[str, float], base: float, errs: list[float], label: str) -> None:
    """Print one shape's times and ratios (base time / path time), and keep the ratios for the geomeans."""
    paths = list(t)[1:]
    for a in paths:
        ratios.setdefault((size, a), []).append(base / t[a])
    print(f"{label} | " + " ".join(f"{t[a]:7.0f}" for a in t) + " | " + " ".join(f"{base / t[a]:5.2f}" for a in paths)
          + " | " + " ".join(f"{e:.0e}" for e in errs), flush=True)


def dense(ms: list[int]) -> None:
    fmt = get_format("int4")
    ratios: dict[tuple[int, str], list[float]] = {}
    print(f"{'model':16} {'layer':12} {'N':>6} {'K':>6} {'M':>6} | bf16, dq, " + ", ".join(TILES)
          + " (us) | x bf16 | err")
    for model, layers in bk.DENSE.items():
        for layer, n, k in layers:
            w = bk.randn(n, k, scale=0.02)
            packed = fmt.random_packed((n, k), device="cuda")
            pw = resolve("int4", packed, stacked=False)
            wb = kernels.dequantize("int4", packed, torch.bfloat16)
            for m in ms:
                x = bk.randn(m, k)
                out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
                ref = F.linear(x, wb)
                t = {"bf16": bk.us(F.linear, x, w), "dq": bk.us(bk.dq_linear, x, packed)}
                errs = []
                for name, tile in TILES.items():
                    errs.append(_err(wg.wgmma_int4(x, pw, out, tickets, tile), ref))
                    t[name] = bk.us(wg.wgmma_int4, x, pw, out, tickets, tile)
                _row(ratios, m, t, t["bf16"], errs, f"{model:16} {layer:12} {n:6} {k:6} {m:6}")
            del w, packed, wb
            torch.cuda.empty_cache()
    for (m, a), v in sorted(ratios.items()):
        print(f"-- dense M={m} {a}: geomean x bf16 {_geomean(v)}")


def moe(token_counts: list[int]) -> None:
    ratios: dict[tuple[int, str], list[float]] = {}
    print(f"{'model':16} {'proj':8} {'E':>4} {'N':>5} {'K':>5} {'tokens':>6} | gmm, dq, " + ", ".join(TILES)
          + " (us) | x grouped_mm | err")
    for model, (experts, top_k, hidden, inter, _) in bk.MOE.items():
        for proj, n, k in (("gate_up", 2 * inter, hidden), ("down", hidden, inter)):
            w = bk.randn(experts, n, k, scale=0.02)
            qe = QuantExperts(experts, k, n, "int4", dtype=torch.bfloat16).cuda()
            qe.random_init(torch.Generator("cuda").manual_seed(0))
            packed, per_chunk = qe.packed("gate_proj"), qe.experts_per_chunk()
            pw = resolve("int4", packed, stacked=True)
            wb = kernels.dequantize("int4", packed, torch.bfloat16)
            for tokens in token_counts:
                rows = tokens * top_k
                counts = torch.bincount(torch.randint(experts, (rows,), device="cuda"), minlength=experts)
                ends = counts.cumsum(0).to(torch.int32)
                offsets = torch.cat([ends.new_zeros(1), ends])
                x = bk.randn(rows, k)
                out = torch.empty(rows, n, dtype=torch.bfloat16, device="cuda")
                ref = bk.GROUPED_MM(x, wb.transpose(1, 2), offs=ends)
                t = {"gmm": bk.us(bk.GROUPED_MM, x, w.transpose(1, 2), offs=ends),
                     "dq": bk.us(bk.chunked, x, qe, "gate_proj", counts.tolist(), per_chunk, dx=False)}
                errs = []
                for name, tile in TILES.items():
                    errs.append(_err(wg.wgmma_int4_grouped(x, offsets, pw, out, tile), ref))
                    t[name] = bk.us(wg.wgmma_int4_grouped, x, offsets, pw, out, tile)
                _row(ratios, tokens, t, t["gmm"], errs, f"{model:16} {proj:8} {experts:4} {n:5} {k:5} {tokens:6}")
            del w, qe, wb
            torch.cuda.empty_cache()
    for (tokens, a), v in sorted(ratios.items()):
        print(f"-- moe {tokens} tokens {a}: geomean x grouped_mm {_geomean(v)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default="dense,moe")
    ap.add_argument("--m", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384, 32768])
    args = ap.parse_args()
    sections = args.sections.split(",")
    if "dense" in sections:
        dense(args.m)
    if "moe" in sections:
        moe(args.tokens)


if __name__ == "__main__":
    main()
