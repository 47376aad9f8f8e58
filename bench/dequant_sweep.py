"""Sweep of the one-pass int4 -> bf16 dequantize and of training through it, on the GPU machine.

    python bench/dequant_sweep.py [--budget SECONDS] [--sections dequant,train]

dequant: the old and new kernels.dequantize timed with do_bench and graph_us (the difference is the host cost that
do_bench cannot hide), the host cost per call on a tiny weight and its parts, int4 tile variants, and a device copy /
fill for the bandwidth ceiling. train: dequantize + cuBLAS against bf16, forward + dX, at M = 4096. (Split from
bench/gemv_sweep.py, whose other sections are the decode kernels'.)
"""

from __future__ import annotations

import importlib.util
import os
import time

import torch
import torch.nn.functional as F
import triton
from orbit_lightning.kernels import dequant_weight
from orbit_lightning.kernels.formats import resolve

from orbit_lightning import kernels
from orbit_lightning.quant.formats import get_format

_spec = importlib.util.spec_from_file_location("bench_kernels", os.path.join(os.path.dirname(__file__), "kernels.py"))
bk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bk)
graph_us, us, packed_bytes = bk.graph_us, bk.us, bk.packed_bytes

say, gm = bk.Log("dequant_sweep.log"), bk.geomean


def old_dequantize(packed: dict) -> torch.Tensor:
    """kernels.dequantize as it was: an arange of expert ids per call, 64x128 tiles, 16-byte word loads."""
    w = resolve("int4", packed, stacked=False)
    ids = torch.arange(1, device=w.values.device, dtype=torch.int32)
    out = torch.empty((1, w.n, w.k), dtype=torch.bfloat16, device=w.values.device)
    values, scale = w.values.unsqueeze(0), w.scale.unsqueeze(0)
    dequant_weight._dequant_kernel[(triton.cdiv(w.n, 64), triton.cdiv(w.k, 128), 1)](
        values, scale, scale, out, ids, w.n, w.k, w.scale.shape[-1],
        values.stride(0), values.stride(1), scale.stride(0), scale.stride(1), out.stride(0), out.stride(1),
        FMT=0, GROUP=w.group, BN=64, BK=128, K_EVEN=w.k % 128 == 0, FAST_INT4=True, HAS_IDS=True, num_warps=4,
    )  # fmt: skip
    return out[0]


def host_us(fn, *args, calls: int = 300) -> float:
    fn(*args)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def section_dequant(deadline: float) -> None:
    say("\n== int4-g32 -> bf16 dequantize: us (TB/s = packed read + bf16 write bytes / time) ==")
    fmt = get_format("int4")
    tiny = fmt.random_packed((64, 256), device="cuda")
    new = lambda p: kernels.dequantize("int4", p)  # noqa: E731
    say(f"host cost per call (tiny 64x256 weight, wall clock): old {host_us(old_dequantize, tiny):5.1f} us, "
        f"new {host_us(new, tiny):5.1f} us")  # fmt: skip
    w = resolve("int4", tiny, stacked=False)
    values, scale = w.values.unsqueeze(0), w.scale.unsqueeze(0)
    out = torch.empty((1, w.n, w.k), dtype=torch.bfloat16, device="cuda")

    def launch_only():
        dequant_weight._dequant_int4_kernel[(2, 1, 1)](
            values, scale, out, scale, w.n, w.k, w.scale.shape[-1],
            values.stride(0), values.stride(1), scale.stride(0), scale.stride(1), out.stride(0), out.stride(1),
            GROUP=32, BN=32, BK=256, K_EVEN=True, HAS_IDS=False, STORE_CACHE="", num_warps=4,
        )  # fmt: skip

    say(f"  of which: resolve {host_us(resolve, 'int4', tiny, False):5.1f} us, torch.empty "
        f"{host_us(torch.empty, (1, 64, 256)):5.1f} us (cpu), triton launch {host_us(launch_only):5.1f} us, "
        f"an empty torch op {host_us(torch.Tensor.zero_, torch.empty(1, device='cuda')):5.1f} us")  # fmt: skip
    say(f"{'N':>6} {'K':>6} | {'copy':>6} | {'old bench':>9} {'old graph':>9} | {'new bench':>9} {'new graph':>9} "
        f"{'TB/s':>5} | tile variants (graph us)")  # fmt: skip
    tiles = [(32, 256, 4), (16, 256, 4), (64, 256, 4), (64, 256, 8), (128, 256, 8), (8, 256, 2), (32, 256, 8)]
    for n, k in ((24576, 4096), (4096, 4096), (5120, 2048), (4096, 12288), (2048, 4096), (36864, 7168),
                 (9216, 4096)):  # fmt: skip
        if time.time() > deadline:
            say("(budget: dequant cut short)")
            return
        packed = fmt.random_packed((n, k), device="cuda")
        if not torch.equal(new(packed), old_dequantize(packed)):
            say(f"  WRONG: new dequantize differs from the old one at {n}x{k}")
        byts = packed_bytes(packed) + 2 * n * k
        src = torch.empty(n, k, dtype=torch.bfloat16, device="cuda")
        dst = torch.empty_like(src)
        copy = graph_us(dst.copy_, src)
        fill = graph_us(dst.zero_)
        t = [us(old_dequantize, packed), graph_us(old_dequantize, packed), us(new, packed), graph_us(new, packed)]
        variants = []
        saved = dequant_weight.INT4_TILE
        for tile in tiles:
            dequant_weight.INT4_TILE = tile
            try:
                variants.append(f"{tile[0]}x{tile[1]}w{tile[2]}:{graph_us(new, packed):.1f}")
            except Exception as e:
                variants.append(f"{tile}:{type(e).__name__}")
            finally:
                dequant_weight.INT4_TILE = saved
        dequant_weight.INT4_STORE_CACHE = ".cs"
        variants.append(f"streaming-stores:{graph_us(new, packed):.1f}")
        dequant_weight.INT4_STORE_CACHE = ""
        say(f"{n:6} {k:6} | {copy:6.1f} | {t[0]:9.1f} {t[1]:9.1f} | {t[2]:9.1f} {t[3]:9.1f} {byts / t[3] / 1e6:5.2f} | "
            + " ".join(variants)
            + f"  (copy {4 * n * k / copy / 1e6:.2f} TB/s, write-only {2 * n * k / fill / 1e6:.2f})")  # fmt: skip
        del src, dst
        torch.cuda.empty_cache()


def section_train(deadline: float) -> None:
    say("\n== training M=4096: bf16 (F.linear + dy @ W) vs dequantize + cuBLAS, do_bench us ==")
    fmt = get_format("int4")
    ratios = []
    for model, layers in bk.DENSE.items():
        for layer, n, k in layers:
            if time.time() > deadline:
                say("(budget: train cut short)")
                return
            packed = fmt.random_packed((n, k), device="cuda")
            w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
            x, dy = torch.randn(4096, k, device="cuda").bfloat16(), torch.randn(4096, n, device="cuda").bfloat16()
            t = [
                us(F.linear, x, w),
                us(torch.matmul, dy, w),
                us(bk.dq_linear, x, packed),
                us(bk.dq_linear_dx, dy, packed),
            ]
            r = (t[0] + t[1]) / (t[2] + t[3])
            ratios.append(r)
            say(f"{model + '.' + layer:28} {n:6} {k:6} | bf16 {t[0]:7.1f} + {t[1]:7.1f} | dq+mm {t[2]:7.1f} + "
                f"{t[3]:7.1f} | {r:4.2f}x")  # fmt: skip
            del w, x, dy
            torch.cuda.empty_cache()
    say(f"training dq+mm / bf16 geomean {gm(ratios):4.2f} min {min(ratios):4.2f} (target >= 0.9)")


def main() -> None:
    sections = {"dequant": section_dequant, "train": section_train}
    bk.run_sweep(__doc__, "dequant_sweep.py", say, sections, "dequant,train")


if __name__ == "__main__":
    main()
