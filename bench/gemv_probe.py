"""Timing probe of the M = 1 mma GEMV (kernels/gemv_mma.py): what leaving instruction classes out of its per-tile PTX
would gain, on the 12 dense shapes of bench/kernels.py. The outputs are WRONG for every variant but `ship`; only
the time means anything. It bounds what any cheaper decode of the same words can buy at M = 1.

    python bench/gemv_probe.py ship noscale nofma noprmt nodecode

ship: the shipped text. noscale: without the fma by the scale. nofma: without both fmas (the -136 offset and the
scale). noprmt: also without the activation prmts (movs instead). nodecode: also without the shr and lop3 (the raw
word as the operand). Each variant runs in a subprocess of its own (the kernel's PTX is a constexpr, so each text
compiles a kernel of its own; the cache dir is per variant).
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys

VARIANTS = ("ship", "noscale", "nofma", "noprmt", "nodecode")


def probe_text(text: str, variant: str) -> str:
    """The tile PTX `text` with the instructions `variant` leaves out removed (or made movs)."""
    out = []
    for line in text.split("\n"):
        s = line.strip()
        scale_fma = s.startswith("fma.rn.bf16x2") and ("slo" in s or "shi" in s)
        if (variant == "noscale" and scale_fma) or (variant in VARIANTS[2:] and s.startswith("fma.rn.bf16x2")):
            continue
        if variant in VARIANTS[3:] and s.startswith("prmt.b32 x"):
            dst, src = (p.rstrip(",") for p in s.split()[1:3])
            line = f"mov.b32 {dst}, {src};"
        if variant == "nodecode" and s.startswith("shr.u32 w"):
            continue
        if variant == "nodecode" and s.startswith("lop3.b32"):
            dst, src = (p.rstrip(",") for p in s.split()[1:3])
            line = f"mov.b32 {dst}, {src};"
        out.append(line)
    return "\n".join(out)


def run_variant(variant: str) -> None:
    import torch
    import torch.nn.functional as F
    import triton.language as tl
    from orbit_lightning.kernels import gemv_mma

    from orbit_lightning import kernels
    from orbit_lightning.quant.formats import get_format

    if variant != "ship":
        gemv_mma._TILE1 = tl.constexpr(probe_text(gemv_mma._tile_asm(1), variant))
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location("bench_kernels", os.path.join(here, "kernels.py"))
    bk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bk)
    fmt = get_format("int4")
    ratios = []
    for model, layers in bk.DENSE.items():
        for layer, n, k in layers:
            w = bk.randn(n, k, scale=0.02)
            packed = fmt.random_packed((n, k), device="cuda")
            x = bk.randn(1, k)
            bf16, int4 = bk.graph_us(F.linear, x, w), bk.graph_us(kernels.int4_linear, x, packed)
            ratios.append(bf16 / int4)
            line = f"{variant:9} {model:16} {layer:12} bf16 {bf16:7.1f} int4 {int4:7.1f} x {bf16 / int4:5.2f}"
            print(line, flush=True)
            del w, packed
            torch.cuda.empty_cache()
    print(f"{variant:9} GEOMEAN M=1 x {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}", flush=True)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        return run_variant(sys.argv[2])
    for variant in sys.argv[1:] or VARIANTS:
        if variant not in VARIANTS:
            sys.exit(f"bench/gemv_probe.py: unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
        env = dict(os.environ, TRITON_CACHE_DIR=os.path.join("/tmp", f"gemv_probe_{variant}"))
        subprocess.run([sys.executable, __file__, "--child", variant], env=env, check=True)


if __name__ == "__main__":
    main()
