"""The warpgroup-MMA int4 GEMM at training sizes (kernels/wgmma_int4.py, Tile TRAIN), on the GPU:

    python bench/wgmma_train.py [--sections dense,moe] [--m 4096 16384] [--tokens 8192 16384 32768]

dense: the 12 shapes of bench/kernels.py, forward y = x W^T and dX dy W: bf16 cuBLAS ("base"), one-pass dequantize
+ cuBLAS ("dq": what quant/dispatch.py runs for many rows) and the fused kernels ("wg": wgmma_int4 at Tile TRAIN,
wgmma_int4_dx), which read only the packed bytes. moe: bench/kernels.py's MoE projections, rows sorted by expert:
bf16 torch grouped_mm ("base"), the chunked path as it was before these kernels (dequantize the chunk's experts +
grouped_mm) and the grouped kernels on device offsets. Times are do_bench medians in microseconds; ratios are base
time / path time; errors are max |y - reference| / max |reference| against the same product on the decoded bf16
weights.
"""

import argparse
import importlib.util
import math
import os

import torch
import torch.nn.functional as F
from orbit_lightning.kernels import configs
from orbit_lightning.kernels import wgmma_int4 as wg
from orbit_lightning.kernels import wgmma_int4_dx as wdx
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


def tickets(count: int) -> torch.Tensor:
    return _tickets(torch.device("cuda", torch.cuda.current_device()), count)


def _row(ratios: dict, size: int, t: dict[str, float], errs: list[float], label: str) -> None:
    """Print one shape's times (base, dq, wg for the forward, then for dX) and the ratios base / path of each and of
    fwd + dX, and keep the ratios for the geomeans."""
    r = {}
    for p in ("dq", "wg"):
        r[f"{p} fwd"] = t["base_fwd"] / t[f"{p}_fwd"]
        r[f"{p} dX"] = t["base_dx"] / t[f"{p}_dx"]
        r[f"{p} fwd+dX"] = (t["base_fwd"] + t["base_dx"]) / (t[f"{p}_fwd"] + t[f"{p}_dx"])
    for a, v in r.items():
        ratios.setdefault((size, a), []).append(v)
    print(f"{label} | " + " ".join(f"{v:7.0f}" for v in t.values()) + " | "
          + " ".join(f"{r[f'{p} {d}']:4.2f}" for d in ("fwd", "dX", "fwd+dX") for p in ("dq", "wg"))
          + " | " + " ".join(f"{e:.0e}" for e in errs), flush=True)


HEADER = ("{} | base, dq, wg fwd; base, dq, wg dX (us) | x base: fwd dq wg, dX dq wg, fwd+dX dq wg | err fwd dX")


def dense(ms: list[int]) -> None:
    fmt = get_format("int4")
    ratios: dict[tuple[int, str], list[float]] = {}
    print(HEADER.format(f"{'model':16} {'layer':12} {'N':>6} {'K':>6} {'M':>6}"))
    for model, layers in bk.DENSE.items():
        for layer, n, k in layers:
            w = bk.randn(n, k, scale=0.02)
            packed = fmt.random_packed((n, k), device="cuda")
            pw = resolve("int4", packed, stacked=False)
            wb = kernels.dequantize("int4", packed, torch.bfloat16)
            for m in ms:
                x, dy = bk.randn(m, k), bk.randn(m, n)
                out, dx = torch.empty(m, n, dtype=torch.bfloat16, device="cuda"), torch.empty_like(x)
                errs = [_err(wg.wgmma_int4(x, pw, out, tickets, wg.TRAIN), F.linear(x, wb)),
                        _err(wdx.wgmma_int4_dx(dy, pw, dx), dy @ wb)]
                t = {"base_fwd": bk.us(F.linear, x, w), "dq_fwd": bk.us(bk.dq_linear, x, packed),
                     "wg_fwd": bk.us(wg.wgmma_int4, x, pw, out, tickets, wg.TRAIN),
                     "base_dx": bk.us(torch.matmul, dy, w), "dq_dx": bk.us(bk.dq_linear_dx, dy, packed),
                     "wg_dx": bk.us(wdx.wgmma_int4_dx, dy, pw, dx)}
                _row(ratios, m, t, errs, f"{model:16} {layer:12} {n:6} {k:6} {m:6}")
            del w, packed, wb
            torch.cuda.empty_cache()
    for (m, a), v in sorted(ratios.items()):
        print(f"-- dense M={m} {a}: geomean x bf16 {_geomean(v)}")


def moe(token_counts: list[int]) -> None:
    ratios: dict[tuple[int, str], list[float]] = {}
    print(HEADER.format(f"{'model':16} {'proj':8} {'E':>4} {'N':>5} {'K':>5} {'tokens':>6}"))
    for model, (experts, top_k, hidden, inter, _) in bk.MOE.items():
        for proj, n, k in (("gate_up", 2 * inter, hidden), ("down", hidden, inter)):
            w = bk.randn(experts, n, k, scale=0.02)
            qe = QuantExperts(experts, k, n, "int4", dtype=torch.bfloat16).cuda()
            qe.random_init(torch.Generator("cuda").manual_seed(0))
            packed, per_chunk = qe.packed("gate_proj"), qe.experts_per_chunk()
            pw = resolve("int4", packed, stacked=True)
            for tokens in token_counts:
                rows = tokens * top_k
                counts = torch.bincount(torch.randint(experts, (rows,), device="cuda"), minlength=experts)
                ends = counts.cumsum(0).to(torch.int32)
                offsets = torch.cat([ends.new_zeros(1), ends])
                host = counts.tolist()
                x, dy = bk.randn(rows, k), bk.randn(rows, n)
                out, dx = torch.empty(rows, n, dtype=torch.bfloat16, device="cuda"), torch.empty_like(x)
                configs.WGMMA_INT4 = False  # the chunked path as it was: dequantize the chunk, grouped_mm
                refs = [torch.cat(bk.chunked(a, qe, "gate_proj", host, per_chunk, dx=d)) for a, d in ((x, 0), (dy, 1))]
                errs = [_err(wg.wgmma_int4_grouped(x, offsets, pw, out), refs[0]),
                        _err(wdx.wgmma_int4_dx(dy, pw, dx, offsets), refs[1])]
                t = {"base_fwd": bk.us(bk.GROUPED_MM, x, w.transpose(1, 2), offs=ends),
                     "dq_fwd": bk.us(bk.chunked, x, qe, "gate_proj", host, per_chunk, dx=False),
                     "wg_fwd": bk.us(wg.wgmma_int4_grouped, x, offsets, pw, out),
                     "base_dx": bk._grouped_mm_dx_us(bk.us, dy, w, ends),
                     "dq_dx": bk.us(bk.chunked, dy, qe, "gate_proj", host, per_chunk, dx=True),
                     "wg_dx": bk.us(wdx.wgmma_int4_dx, dy, pw, dx, offsets)}
                configs.WGMMA_INT4 = True
                _row(ratios, tokens, t, errs, f"{model:16} {proj:8} {experts:4} {n:5} {k:5} {tokens:6}")
            del w, qe
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
