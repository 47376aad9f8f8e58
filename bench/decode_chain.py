"""The dense decode layer's kernels chained as the engine runs them, under a CUDA graph: what PDL buys each launch,
and whether every setting keeps the bits.

bench/kernels.py times one kernel behind an L2 flush, where the kernel before it (the flush) never lets it start
early; bench/rollout.py times whole steps, where sampling and attention add ~4 % run-to-run noise. This times only
Qwen3-8B's projections at M = 9-64 rows (the warpgroup-MMA int4 kernel) between the kernels that produce their
activations (rms_norm, add_rms_norm, silu_mul; the attention's output stands in as the q part of qkv), over `--layers`
layers of distinct random int4 weights, and A/Bs in one process, alternating:

- shipped:  PDL for every kernel that takes it, wgmma_int4 included,
- plain-wg: the same but wgmma_int4 launched plain (wgmma_int4.PDL_LAUNCH off: it waits for the kernel before it to
            finish before it starts),
- none:     no PDL at all (kernels.pdl.ENABLED = False).

    python bench/decode_chain.py [--m 16 32 64] [--layers 8] [--rounds 5]

Prints us per layer (median over rounds, each the mean of --replays back-to-back graph replays), then where each
setting's outputs, replayed and eager, first differ from the eager chain without PDL (they should not). Each graph
keeps its static input alive: a graph holds no reference to the tensors it reads, and a freed input's memory, taken
by a later allocation, read as the first projection's wrong sums in an earlier version of this script.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from orbit_lightning.kernels import pdl
from orbit_lightning.kernels import wgmma_int4 as wg

from orbit_lightning import kernels
from orbit_lightning.quant.formats import get_format

HIDDEN, Q, QKV, INTER = 4096, 4096, 6144, 12288  # Qwen3-8B
SETTINGS = ("shipped", "plain-wg", "none")


def layer_weights(layers: int, device: str) -> list[dict]:
    fmt = get_format("int4")
    gen = torch.Generator(device=device).manual_seed(0)
    shapes = {"qkv": (QKV, HIDDEN), "o": (HIDDEN, Q), "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}
    return [{name: fmt.random_packed(shape, device=device, generator=gen) for name, shape in shapes.items()}
            for _ in range(layers)]


PROJECTIONS = ("qkv", "o", "gate_up", "down")


def chain(h: torch.Tensor, weights: list[dict], norm: torch.Tensor) -> list[torch.Tensor]:
    """Every layer's projection outputs, in launch order."""
    x = kernels.rms_norm(h, norm)
    outs = []
    for w in weights:
        qkv = kernels.dequant_linear(x, "int4", w["qkv"])
        o = kernels.dequant_linear(qkv[:, :Q], "int4", w["o"])
        h, x = kernels.add_rms_norm(o, h, norm)
        gate_up = kernels.dequant_linear(x, "int4", w["gate_up"])
        down = kernels.dequant_linear(kernels.silu_mul(gate_up[:, :INTER], gate_up[:, INTER:]), "int4", w["down"])
        h, x = kernels.add_rms_norm(down, h, norm)
        outs += [qkv, o, gate_up, down]
    return outs


def first_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> str:
    """'-' when a and b are bitwise equal, else the first (layer, projection) that differs and by how much."""
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if not torch.equal(x, y):
            diff = (x.float() - y.float()).abs()  # (NaNs count as differing, and make the max nan)
            return (f"L{i // 4}.{PROJECTIONS[i % 4]}: {int((x != y).sum())} of {diff.numel()} differ, "
                    f"max {diff.max().item():.3g}")
    return "-"


def apply(setting: str) -> None:
    if setting not in SETTINGS:
        raise ValueError(f"unknown setting {setting!r}; choose from {SETTINGS}")
    pdl.ENABLED = setting != "none"
    wg.PDL_LAUNCH = setting != "plain-wg"


def hidden(m: int) -> torch.Tensor:
    return torch.randn(m, HIDDEN, generator=torch.Generator("cuda").manual_seed(m), device="cuda").bfloat16()


def capture(h: torch.Tensor, weights: list[dict], norm: torch.Tensor, stream: torch.cuda.Stream):
    """(graph, its outputs, the same chain run eagerly), captured on `stream` after the eager run there, which warms
    it up as the engine's DecodeGraphs does (the kernels' per-stream buffers, e.g. the split-K tickets, exist before
    the capture). The caller keeps h alive for as long as it replays the graph."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        eager = chain(h, weights, norm)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = chain(h, weights, norm)
    return graph, out, eager


def replay_us(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / replays


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--replays", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/decode_chain.py needs a CUDA GPU")
    weights = layer_weights(args.layers, "cuda")
    norm = torch.rand(HIDDEN, generator=torch.Generator("cuda").manual_seed(1), device="cuda").bfloat16() + 0.5
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | Qwen3-8B x {args.layers} layers | us per "
          f"layer (median of {args.rounds} rounds x {args.replays} replays)")
    print(f"{'M':>4} " + "".join(f"{s:>9}" for s in SETTINGS) + "   shipped/plain-wg  shipped/none")
    for m in args.m:
        h, graphs = hidden(m), {}
        for setting in SETTINGS:
            apply(setting)
            graphs[setting] = capture(h, weights, norm, torch.cuda.Stream())
        apply("shipped")
        times = {s: [] for s in SETTINGS}
        for _ in range(args.rounds):
            for s in SETTINGS:
                times[s].append(replay_us(graphs[s][0], args.replays) / args.layers)
        med = {s: statistics.median(t) for s, t in times.items()}
        print(f"{m:>4} " + "".join(f"{med[s]:9.1f}" for s in SETTINGS)
              + f"   {med['shipped'] / med['plain-wg']:16.3f} {med['shipped'] / med['none']:13.3f}", flush=True)
        # Bits: every setting's graph and eager outputs against the eager chain without PDL (the launches in order).
        ref = graphs["none"][2]
        for s in SETTINGS:
            eager = "(the reference)" if s == "none" else first_difference(graphs[s][2], ref)
            print(f"     {s:8} graph vs eager none: {first_difference(graphs[s][1], ref)}; eager vs eager none: "
                  f"{eager}", flush=True)


if __name__ == "__main__":
    main()
