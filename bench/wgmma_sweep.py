"""The warpgroup-MMA int4 GEMM (kernels/wgmma_int4.py) against bf16 cuBLAS and the dispatch without it, on the GPU:

    python bench/wgmma_sweep.py [--m 16 32 64] [--programs 2 3 4] [--registers 80] [--l2-flush read]

For the 12 dense shapes of bench/kernels.py at each M: bf16 cuBLAS, the dispatch with configs.WGMMA_INT4 off ("tile":
the tile kernel, or the decode GEMVs at M <= 16), and the wgmma kernel called directly at each register cap per thread
(r80: 80; "ship": wgmma_int4.max_registers) and each K-split target (p2: wgmma_int4.PROGRAMS_PER_SM = 2). graph_us
in microseconds; ratios are bf16 time / kernel time, geomean over the shapes; errors are max |y - fp32 reference|
over max |reference|. Behind bench/RESULTS.md's wgmma tables (twelfth to fourteenth sessions).
"""
import argparse
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
SHIPPED = wg.max_registers, wg.PROGRAMS_PER_SM, wg.MIN_ROWS


def direct(x, pw, n: int, regs: int | None, programs: int) -> torch.Tensor:
    """The wgmma kernel on x (bypassing the dispatch) at `regs` registers per thread (None: the shipped choice) and
    `programs` per SM."""
    wg.max_registers = SHIPPED[0] if regs is None else (lambda bm, group: regs)
    wg.PROGRAMS_PER_SM, wg.MIN_ROWS = programs, 1
    out = torch.empty(x.shape[0], n, dtype=torch.bfloat16, device="cuda")
    try:
        return wg.wgmma_int4(x, pw, out, lambda c: _tickets(x.device, c))
    finally:
        wg.max_registers, wg.PROGRAMS_PER_SM, wg.MIN_ROWS = SHIPPED


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--programs", type=int, nargs="+", default=[wg.PROGRAMS_PER_SM], help="K-split targets per SM")
    ap.add_argument("--registers", type=int, nargs="+", default=[0], help="register caps; 0: the shipped choice")
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
                x = bk.randn(m, k)
                ref = x.float() @ ref_w.T
                t = {"bf16": bk.graph_us(F.linear, x, w)}
                configs.WGMMA_INT4 = False
                t["tile"] = bk.graph_us(kernels.int4_linear, x, packed)
                configs.WGMMA_INT4 = True
                errs = []
                for regs in args.registers:
                    for programs in args.programs:
                        name = f"{'ship' if not regs else f'r{regs}'}p{programs}"
                        y = direct(x, pw, n, regs or None, programs)
                        err = (y.float() - ref).abs().max().item() / ref.abs().max().item()
                        errs.append(f"{err:.1e}")
                        if err < 4 * 2**-8:  # else WRONG: no time
                            t[name] = bk.graph_us(direct, x, pw, n, regs or None, programs)
                        else:
                            print(f"WRONG {name} {model}.{layer} M={m}: {err:.2e}")
                for name, v in t.items():
                    ratios.setdefault((m, name), []).append(t["bf16"] / v)
                print(f"{model:16} {layer:12} {n:6} {k:6} {m:3} | " + " ".join(f"{a} {v:6.1f}" for a, v in t.items())
                      + f" | err {' '.join(errs)}", flush=True)  # fmt: skip
            torch.cuda.empty_cache()
    for m in args.m:
        print(f"-- M={m}: geomean x over bf16: " + "; ".join(
            f"{name} {math.exp(sum(map(math.log, v)) / len(v)):.2f} (min {min(v):.2f}, n={len(v)})"
            for (mm, name), v in sorted(ratios.items()) if mm == m))  # fmt: skip


if __name__ == "__main__":
    main()
