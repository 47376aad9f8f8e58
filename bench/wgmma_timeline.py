"""Where the decode-tile wgmma_int4's microseconds go: per-program timestamps (kernels/timeline.py) on the GPU machine.

    python bench/wgmma_timeline.py [--m 16] [--reps 5] [--programs 2] [--regs 80]

For dense decode shapes (int4 g32, the tile and K split the dispatch picks; --programs: the K-split target per SM;
--regs: registers per thread at launch), each run starts after an L2 read flush and records, per program, its SM,
entry and exit on the global ns timer, and cycle counts at entry, when its first step's words and activations had
landed, and after its last wgmma. Printed per shape (medians over --reps runs, us from the first program's entry;
per-program phases as medians over programs):
- span: last exit; the kernel alone by graph_us for comparison; programs, K splits and steps per program;
- start p50 / max: when programs entered;
- fill: entry to the first step's data, as issue (entry to the loader's first load: barrier set-up, the
  register hand-off) and latency (that load to its data: descriptor fetch, the memory);
- steps: first data to the last wgmma (the steady state), and per step;
- tail: last wgmma to exit (store, and with a K split the partials, the ticket and the last program's sum);
- loop end p50 / max: when programs' last wgmmas were done, and that p50 on the SMs that ran the most programs and
  on those that ran the fewest (how much of the span is programs finishing their steady state at different times).
Each phase is timed on one clock, the SM's cycles, converted at the clock a timed spin measured (if the SM runs
slower in the kernel, all three read short alike); span and start are on the global timer. Mixing the two (the
global timer's exit less a cycle-timed loop end) read the tail 1-2 us long.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics

import torch
from orbit_lightning.kernels import wgmma_int4 as wg
from orbit_lightning.kernels.configs import sm_count
from orbit_lightning.kernels.formats import resolve
from orbit_lightning.kernels.gemm import _tickets
from orbit_lightning.kernels.timeline import CYCLES, ENTRY_NS, EXIT_NS, SLOTS, SM_ID

from orbit_lightning.quant.formats import get_format

SHAPES = [("Qwen3-8B qkv", 6144, 4096), ("Qwen3-8B o", 4096, 4096), ("Qwen3-8B gate_up", 24576, 4096),
          ("Qwen3-8B down", 4096, 12288), ("Qwen3-30B-A3B qkv", 5120, 2048),
          ("DeepSeek-V3 mlp.gate_up", 36864, 7168)]  # fmt: skip
MAX_PROGRAMS = 1 << 14


def _bench_module(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(__file__), f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench_kernels = _bench_module("kernels")
clock_hz = _bench_module("gemv_timeline").clock_hz


def call(x, w, tile, stamps=None):
    out = torch.empty(x.shape[0], w.n, dtype=torch.bfloat16, device="cuda")
    return wg.wgmma_int4(x, w, out, lambda c: _tickets(x.device, c), tile, stamps=stamps)


def one_run(x, w, tile, hz) -> dict:
    stamps = torch.zeros((MAX_PROGRAMS, SLOTS), dtype=torch.int64, device="cuda")
    bench_kernels._flush_l2()  # (bench/kernels.py's flush, its FLUSH_MODE: clean lines, as in a decode step)
    torch.cuda.synchronize()
    call(x, w, tile, stamps)
    torch.cuda.synchronize()
    st = stamps[stamps[:, ENTRY_NS] > 0].cpu().double()
    t0 = st[:, ENTRY_NS].min()
    start = (st[:, ENTRY_NS] - t0) / 1e3

    def at(slot) -> torch.Tensor:
        """When each program reached cycle stamp `slot`, us from the first entry (its cycles since its own entry)."""
        return start + (st[:, slot.value] - st[:, CYCLES]) / hz * 1e6

    first, issue, loop_end, exit_cycles = at(wg.FIRST_DATA), at(wg.FIRST_ISSUE), at(wg.LOOP_END), at(wg.EXIT_CYCLES)
    exit_ = (st[:, EXIT_NS] - t0) / 1e3

    def p50(v):
        return torch.quantile(v, 0.5).item()

    sm = st[:, SM_ID].long()
    load = torch.bincount(sm)[sm]  # programs on each program's SM
    return {"span": exit_.max().item(), "programs": len(st), "start_p50": p50(start), "start_max": start.max().item(),
            "fill": p50(first - start), "issue": p50(issue - start), "latency": p50(first - issue),
            "steps": p50(loop_end - first), "tail": p50(exit_cycles - loop_end),
            "tail_max": (exit_cycles - loop_end).max().item(), "end_p50": p50(loop_end),
            "end_max": loop_end.max().item(), "end_busiest": p50(loop_end[load == load.max()]),
            "end_idlest": p50(loop_end[load == load.min()]), "sm_load_max": load.max().item(),
            "sm_load_min": load.min().item()}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[16])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--programs", type=int, default=None, help="Tile.programs_per_sm (0: one full wave)")
    ap.add_argument("--regs", type=int, default=0, help="Tile.regs (0: wgmma_int4.max_registers')")
    args = ap.parse_args()
    hz = clock_hz()
    bench_kernels._FLUSH.append(torch.ones(256 << 20, dtype=torch.int8, device="cuda"))  # (graph_us reuses it)
    fmt = get_format("int4")
    rows = []
    print(f"{torch.cuda.get_device_name()}  SM clock {hz / 1e9:.2f} GHz  (us from the first program's entry)")
    print(f"{'shape':24} {'M':>3} {'graph':>6} {'span':>6} {'progs':>5} {'split':>5} {'steps':>5} | "
          f"{'start p50/max':>13} | {'fill':>5} {'issue':>5} {'lat':>5} {'steps':>6} {'/step':>6} {'tail':>5} "
          f"{'tail max':>8} | "
          f"{'loop end p50/max':>16} {'busiest/idlest SMs':>24}")  # fmt: skip
    for name, n, k in SHAPES:
        packed = fmt.random_packed((n, k), device="cuda")
        w = resolve("int4", packed, stacked=False)
        for m in args.m:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            tile = dataclasses.replace(wg.pick_tile(m, n, sm_count(x.device)), programs_per_sm=args.programs,
                                       regs=args.regs)
            one_run(x, w, tile, hz)  # compile
            runs = [one_run(x, w, tile, hz) for _ in range(args.reps)]
            med = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
            tiles = -(-n // (16 * tile.warps)) * -(-m // (tile.bm or m))
            bm = tile.bm or max(16, 1 << (m - 1).bit_length())
            k_per_split, split = wg.split_k(k, w.group, tiles, tile, sm_count(x.device), bm)
            steps = k_per_split // tile.bk
            med["graph_us"] = bench_kernels.graph_us(call, x, w, tile)
            rows.append({"shape": name, "m": m, "split": split, "steps_per_program": steps, **med})
            print(f"{name:24} {m:3} {med['graph_us']:6.1f} {med['span']:6.1f} {med['programs']:5.0f} {split:5} "
                  f"{steps:5} | {med['start_p50']:6.1f}/{med['start_max']:6.1f} | {med['fill']:5.2f} "
                  f"{med['issue']:5.2f} {med['latency']:5.2f} "
                  f"{med['steps']:6.2f} {med['steps'] / steps:6.3f} {med['tail']:5.2f} {med['tail_max']:8.2f} | "
                  f"{med['end_p50']:7.1f}/{med['end_max']:7.1f} {med['end_busiest']:5.1f} ({med['sm_load_max']:.0f}) "
                  f"/{med['end_idlest']:5.1f} ({med['sm_load_min']:.0f})")
    if os.environ.get("OUT"):
        tag = f"{'' if args.programs is None else f'-p{args.programs}'}{f'-r{args.regs}' if args.regs else ''}"
        with open(os.path.join(os.environ["OUT"], f"wgmma_timeline{tag}.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
