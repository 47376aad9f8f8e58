"""What an L2 prefetch of the next weights buys a decode GEMV (kernels.prefetch_l2), on the GPU machine.

    python bench/l2_prefetch.py [--gaps-us 8 20]

A decode layer runs a GEMV, then a chain of small kernels (norms, RoPE, attention, LoRA) during which HBM is
nearly idle, then the next GEMV. This models the chain as a `torch.cuda._sleep` of `gap` microseconds and
times, by CUDA-graph replay after an L2 flush, the GEMV at M = 1 on Qwen3-8B's layer shapes (int4 g32, as the
engine dispatches it):

    cold      flush, gap, GEMV                 (the engine today)
    pf=f      flush, prefetch f of W, gap, GEMV  (f = fraction of the packed bytes)
    bf16      flush, gap, F.linear on bf16 W    (the same-run baseline)

Each GEMV time is the graph with it minus the same graph without it. `pf cost` is what the prefetch launch adds to
the gap itself (graph with prefetch and gap minus the gap alone).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from orbit_lightning.kernels.prefetch import prefetch_l2

from orbit_lightning import kernels
from orbit_lightning.quant.formats import get_format

SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)]
_FLUSH = torch.empty(0)


def graph_ms(ops, reps: int = 10) -> float:
    """Median ms of one (flush, *ops) sequence, from a CUDA graph of `reps` of them."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            _FLUSH.zero_()
            for op in ops:
                op()
    times = []
    for _ in range(9):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[4] / reps


def bench_shape(name: str, n: int, k: int, gaps_us: list[float], clock_hz: float) -> list[str]:
    fmt = get_format("int4")
    packed = fmt.random_packed((n, k), device="cuda")
    tensors = [packed["weight_packed"], packed["weight_scale"]]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    wbf = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
    x = torch.randn(1, k, device="cuda").bfloat16()

    def gemv():
        return kernels.dequant_linear(x, fmt, packed)

    def bf16():
        return F.linear(x, wbf)

    ref = F.linear(x.float(), kernels.dequantize(fmt, packed).float())
    torch.testing.assert_close(gemv().float(), ref, atol=2e-2 * ref.abs().max().item(), rtol=0)
    lines = []
    for gap_us in gaps_us:
        cycles = int(gap_us * 1e-6 * clock_hz)

        def sleep(c=cycles):
            torch.cuda._sleep(c)

        gemv(), bf16(), prefetch_l2(tensors)
        torch.cuda.synchronize()
        base = graph_ms([sleep])
        cold = graph_ms([sleep, gemv]) - base
        b16 = graph_ms([sleep, bf16]) - base
        pf = {}
        for frac in (0.5, 1.0):

            def pre(f=frac):
                prefetch_l2(tensors, max_bytes=int(f * nbytes))

            pf[frac] = graph_ms([pre, sleep, gemv]) - graph_ms([pre, sleep])
        pf_cost = graph_ms([lambda: prefetch_l2(tensors), sleep]) - base
        lines.append(
            f"{name:8s} {nbytes / 1e6:8.1f}  {gap_us:6.0f}  {cold * 1e3:7.2f}  {pf[0.5] * 1e3:9.2f}  "
            f"{pf[1.0] * 1e3:7.2f}  {b16 * 1e3:7.2f}  {pf_cost * 1e3:10.2f}  "
            f"{nbytes / cold / 1e9:.2f}->{nbytes / pf[1.0] / 1e9:.2f}  {b16 / cold:.2f}->{b16 / pf[1.0]:.2f}"
        )
    return lines


def main() -> None:
    global _FLUSH
    ap = argparse.ArgumentParser()
    ap.add_argument("--gaps-us", type=float, nargs="+", default=[8.0, 20.0])
    args = ap.parse_args()
    torch.manual_seed(0)
    _FLUSH = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    torch.cuda._sleep(1 << 20)  # warm up, then calibrate the spin's cycles per second
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1 << 24)
    end.record()
    end.synchronize()
    clock_hz = (1 << 24) / (start.elapsed_time(end) * 1e-3)
    log = open(os.path.join(os.environ["OUT"], "l2_prefetch.log"), "w") if os.environ.get("OUT") else None

    def say(line: str) -> None:
        print(line, flush=True)
        if log:
            log.write(line + "\n")

    say(f"{torch.cuda.get_device_name()}  clock {clock_hz / 1e9:.2f} GHz (sleep calibration)")
    say("layer    MB(int4)  gap_us  cold_us  pf=0.5_us  pf=1_us  bf16_us  pf_cost_us  TB/s cold->pf=1  "
        "x bf16 cold->pf=1")
    for name, n, k in SHAPES:
        for line in bench_shape(name, n, k, args.gaps_us, clock_hz):
            say(line)
    if log:
        log.close()


if __name__ == "__main__":
    main()
