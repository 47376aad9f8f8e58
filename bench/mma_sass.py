"""The mma GEMV's main loop as sm_90 SASS, on any machine: Triton's compiler with its bundled ptxas and cuobjdump, no
GPU. Per config: registers, local memory (spills), and the main loop's instructions per row tile and K tile, their
mix, and the order of its loads (L) and mmas (H).

    python bench/mma_sass.py [--configs mt1-nt1-u2 mt2-nt1-u2 mt1-nt2-u1] [--k 4096] [--lora]

A config is mt{row tiles a warp}-nt{n8 tiles of activation rows: 1 up to 8 rows, 2 up to 16}-u{K tiles a step}, -p
for the word-pair lane layout (GemvConfig.mma_word_pairs), -i for the warps on alternate K steps (mma_interleave_k),
-t for int4-tiled weights (quant/formats/tiled.py) and -r<N> for a cap of N registers a thread (GemvConfig.maxnreg).

Why: the device's triton (3.6) and this machine's (3.9) bundle different ptxas, and they allocated the same loop 117
and 80 registers (bench/RESULTS.md, "Kernels", twenty-seventh session). With another triton unpacked in a directory
D (`pip install --no-deps --target D triton==3.6.0`), `PYTHONPATH=D python bench/mma_sass.py` shows what the
device's compiler makes of a change before any device time is spent.
"""

from __future__ import annotations

import argparse
import collections
import inspect
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import triton
from orbit_lightning.kernels import gemv_mma
from orbit_lightning.kernels.configs import GemvConfig
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

_POINTERS = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "out_ptr": "*bf16", "la0": "*bf16", "la1": "*bf16",
             "la2": "*bf16", "lb0": "*bf16", "lb1": "*bf16", "lb2": "*bf16", "lpart": "*fp32", "lt": "*i64",
             "lcnt": "*i32", "stamp_ptr": "*i64", "ls0": "fp32", "ls1": "fp32", "ls2": "fp32"}  # fmt: skip
_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


@dataclass
class Loop:
    """A compiled config's main loop: registers and local memory per thread, the loop's instructions (predicates
    dropped), and how many row tile x K tile products one trip makes."""

    registers: int
    local_bytes: int
    instructions: list[str]
    products: int

    @property
    def per_product(self) -> float:
        return len(self.instructions) / self.products

    def mix(self) -> collections.Counter:
        return collections.Counter(i.split()[0].split(".")[0] for i in self.instructions)

    def order(self) -> str:
        return "".join("L" if i.startswith("LDG") else "H" for i in self.instructions if i.startswith(("LDG", "HMMA")))


def parse_config(name: str) -> tuple[int, int, int, bool, bool, bool, int | None]:
    m = re.fullmatch(r"mt(\d)-nt([12])-u([124])(-p)?(-i)?(-t)?(?:-r(\d+))?", name)
    if not m:
        raise SystemExit(f"config {name!r}: expected mt<row tiles>-nt<1|2>-u<1|2|4>[-p][-i][-t][-r<registers>], "
                         "e.g. mt1-nt1-u2")
    return (int(m.group(1)), int(m.group(2)), int(m.group(3)), bool(m.group(4)), bool(m.group(5)),
            bool(m.group(6)), int(m.group(7)) if m.group(7) else None)  # fmt: skip


def compile_sass(mt: int, nt: int, u: int, k: int, lora: bool = False, num_warps: int = 8,
                 pairs: bool = False, interleave: bool = False, tiled: bool = False,
                 maxnreg: int | None = None) -> tuple[str, str]:  # fmt: skip
    """(SASS, cuobjdump's resource usage) of _gemv_mma_kernel for sm_90a, int4 g32 weights with K = k, under a cap
    of maxnreg registers a thread (GemvConfig.maxnreg) if given."""
    names = list(inspect.signature(gemv_mma._gemv_mma_kernel.fn).parameters)
    cfg = GemvConfig(16, 16 * mt, 128, mma=True, mma_tiles=u, l2_prefetch=128, mma_word_pairs=pairs,
                     mma_interleave_k=interleave)
    const = dict(gemv_mma.kernel_constexprs(cfg, 1 if nt == 1 else 16, num_warps, 32, k // 8, k // 32, True, tiled),
                 LORA=lora, BR=16, STAMPS=False)  # fmt: skip
    sig = {n: "constexpr" if n in const else _POINTERS.get(n, "i32") for n in names}
    src = ASTSource(fn=gemv_mma._gemv_mma_kernel, signature=sig,
                    constexprs={(names.index(n),): v for n, v in const.items()})  # fmt: skip
    options = dict(num_warps=num_warps, **({"maxnreg": maxnreg} if maxnreg else {}))
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        run = [subprocess.run([cuobjdump, flag, f.name], capture_output=True, text=True, check=True).stdout
               for flag in ("-sass", "-res-usage")]  # fmt: skip
    return run[0], run[1]


def main_loop(sass: str, usage: str, products: int) -> Loop:
    """The loop in `sass` whose backward branch encloses the most HMMAs: the K loop (the epilogue has none)."""
    code = {int(a, 16): text for a, text in _INSTRUCTION.findall(sass)}
    best: list[str] = []
    for addr, text in code.items():
        target = re.search(r"\bBRA (0x[0-9a-f]+)", text)
        start = int(target.group(1), 16) if target else addr
        if start < addr:
            body = [re.sub(r"^@!?U?P\w+\s+", "", code[a]) for a in sorted(code) if start <= a <= addr]
            if sum(i.startswith("HMMA") for i in body) > sum(i.startswith("HMMA") for i in best):
                best = body
    if not best:
        raise ValueError("no loop with an HMMA in this SASS: not the mma GEMV's main loop")
    regs = re.search(r"REG:(\d+)", usage)
    local = re.search(r"LOCAL:(\d+)", usage)
    if not (regs and local):
        raise ValueError(f"cuobjdump -res-usage gave no REG / LOCAL fields:\n{usage}")
    return Loop(int(regs.group(1)), int(local.group(1)), best, products)


def analyse(name: str, k: int, lora: bool = False) -> Loop:
    mt, nt, u, pairs, interleave, tiled, maxnreg = parse_config(name)
    return main_loop(*compile_sass(mt, nt, u, k, lora, pairs=pairs, interleave=interleave, tiled=tiled,
                                   maxnreg=maxnreg), products=mt * u)  # fmt: skip


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", default=["mt1-nt1-u2", "mt2-nt1-u2", "mt1-nt2-u1", "mt2-nt2-u1"])
    p.add_argument("--k", type=int, default=4096, help="K of the weight (the strides are compile-time)")
    p.add_argument("--lora", action="store_true", help="with the LoRA epilogue")
    args = p.parse_args(argv)
    print(f"triton {triton.__version__} ({os.path.dirname(triton.__file__)}), sm_90a, K = {args.k}")
    print(f"{'config':16} {'regs':>4} {'local':>5} {'loop':>5} {'/tile':>6}  mix; loads (L) and mmas (H) in order")
    for name in args.configs:
        loop = analyse(name, args.k, args.lora)
        mix = ", ".join(f"{op} {n}" for op, n in loop.mix().most_common(6))
        print(f"{name:16} {loop.registers:4d} {loop.local_bytes:5d} {len(loop.instructions):5d} "
              f"{loop.per_product:6.1f}  {mix}; {loop.order()}")  # fmt: skip


if __name__ == "__main__":
    main()
