"""The warpgroup-MMA int4 GEMM (kernels/wgmma_int4.py) against what served 16-64 rows before it, on the GPU machine:

    python bench/wgmma_sweep.py

For the 12 dense shapes of bench/kernels.py at M = 16, 32, 64: bf16 cuBLAS, the dispatch with configs.WGMMA_INT4
off ("tile": the tile kernel; at M = 16 the tile GEMV), and the wgmma kernel called directly at 128 and 80 registers
per thread (wgmma_int4.max_registers ships 80, and 128 at 64 rows with group 128). graph_us (cold L2) in
microseconds; ratios are bf16 time / kernel time; errors are max |y - fp32 reference| over max |reference|. The
script behind bench/RESULTS.md's twelfth-session table (the thirteenth's scale-ring A/B ran a copy of it, .gl/).
"""
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
SHIPPED_REGISTERS = wg.max_registers


def direct(x, pw, n: int, regs: int) -> torch.Tensor:
    """The wgmma kernel on x at `regs` registers per thread (bypassing the dispatch)."""
    wg.max_registers = lambda bm, group: regs
    out = torch.empty(x.shape[0], n, dtype=torch.bfloat16, device="cuda")
    return wg.wgmma_int4(x, pw, out, lambda c: _tickets(x.device, c))


def main() -> None:
    fmt = get_format("int4")
    ratios: dict[tuple[int, str], list[float]] = {}
    for model, layers in bk.DENSE.items():
        for layer, n, k in layers:
            w = bk.randn(n, k, scale=0.02)
            packed = fmt.random_packed((n, k), device="cuda")
            pw = resolve("int4", packed, stacked=False, group_size=32)
            ref_w = kernels.dequantize("int4", packed, torch.float32)
            for m in (16, 32, 64):
                x = bk.randn(m, k)
                ref = x.float() @ ref_w.T
                t = {"bf16": bk.graph_us(F.linear, x, w)}
                configs.WGMMA_INT4 = False
                t["tile"] = bk.graph_us(kernels.int4_linear, x, packed)
                configs.WGMMA_INT4 = True
                errs = []
                for regs in (128, 80):
                    y = direct(x, pw, n, regs)
                    err = (y.float() - ref).abs().max().item() / ref.abs().max().item()
                    errs.append(f"{err:.1e}")
                    if err < 4 * 2**-8:  # else WRONG: no time
                        t[f"wgmma{regs}"] = bk.graph_us(direct, x, pw, n, regs)
                    else:
                        print(f"WRONG wgmma{regs} {model}.{layer} M={m}: {err:.2e}")
                wg.max_registers = SHIPPED_REGISTERS
                for name, v in t.items():
                    ratios.setdefault((m, name), []).append(t["bf16"] / v)
                print(f"{model:16} {layer:12} {n:6} {k:6} {m:3} | " + " ".join(f"{a} {v:6.1f}" for a, v in t.items())
                      + f" | err {' '.join(errs)}", flush=True)  # fmt: skip
            torch.cuda.empty_cache()
    for m in (16, 32, 64):
        print(f"-- M={m}: geomean x over bf16: " + "; ".join(
            f"{name} {math.exp(sum(map(math.log, v)) / len(v)):.2f} (min {min(v):.2f}, n={len(v)})"
            for (mm, name), v in sorted(ratios.items()) if mm == m))  # fmt: skip


if __name__ == "__main__":
    main()
