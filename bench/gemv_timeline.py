"""Where a decode GEMV's microseconds go: per-program timestamps (kernels/timeline.py) on the GPU machine.

    python bench/gemv_timeline.py [--reps 5]

For Qwen3-8B's decode shapes at M = 1 (int4 g32, the dispatched config), without and with a LoRA (r = 16) in the
launch, each run starts after an L2 flush and records, per program, its SM, entry and exit on the global ns
timer, and cycle counts at entry, after the PDL wait, at the end of the main loop and at exit. Printed per case (medians
over --reps runs, microseconds from the first program's entry):
- span: last exit; programs: how many ran (rank programs of the LoRA first);
- start p50 / max: when programs entered (dispatch waves);
- loop p50 / max: when programs ended their main loop, the weight stream (split kernel only; nan for TMA);
- exit p50 / max: when programs left (the split-K and LoRA tails come after the loop);
- tail p50 / max: loop end to exit, both in the SM's cycles (one clock: the global timer's exit less a cycle-timed
  loop end read tails 1-2 us long in wgmma_timeline's first run; nan for TMA);
- rank exit max: when the last LoRA rank program left, i.e. roughly when t was ready.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
from orbit_lightning.kernels import configs, gemm, gemv
from orbit_lightning.kernels.configs import TILE_K, sm_count
from orbit_lightning.kernels.formats import resolve
from orbit_lightning.kernels.gemv_lora import SLICE_ONE_ROW, LoraDelta, rank_slices
from orbit_lightning.kernels.gemv_mma import mma_split
from orbit_lightning.kernels.timeline import CYCLES, ENTRY_NS, EXIT_NS, SLOTS

from orbit_lightning.quant.formats import get_format

SHAPES = [("qkv", 6144, 4096, (4096, 1024, 1024)), ("o", 4096, 4096, (4096,)),
          ("gate_up", 24576, 4096, (12288, 12288)), ("down", 4096, 12288, (4096,))]  # fmt: skip
MAX_PROGRAMS = 1 << 16


def clock_hz() -> float:
    """The SM clock the cycle counters tick at, from a timed spin."""
    torch.cuda._sleep(1 << 20)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1 << 24)
    end.record()
    end.synchronize()
    return (1 << 24) / (start.elapsed_time(end) * 1e-3)


def one_run(x, w, cfg, delta, flush, hz) -> dict:
    stamps = torch.zeros((MAX_PROGRAMS, SLOTS), dtype=torch.int64, device="cuda")
    out = torch.empty((1, w.n), dtype=torch.bfloat16, device="cuda")
    flush.zero_()
    torch.cuda.synchronize()
    gemv.gemv(x, w, out, cfg, lambda n: gemm._tickets(x.device, n), True, delta, stamps)
    torch.cuda.synchronize()
    st = stamps[stamps[:, ENTRY_NS] > 0].cpu()
    t0 = st[:, ENTRY_NS].min().item()
    start = (st[:, ENTRY_NS] - t0) / 1e3
    exit_ = (st[:, EXIT_NS] - t0) / 1e3
    n_rank = 0
    if delta is not None:
        # (the mma kernel's rank programs take one slice per warp of its programs: gemv_mma.py)
        one_row = SLICE_ONE_ROW
        if cfg.mma:
            one_row = TILE_K * mma_split(cfg, w.n, x.shape[1], sm_count(x.device))[1]
        n_rank = len(delta.a) * rank_slices(x.shape[0], x.shape[1], one_row)
    weights = slice(n_rank, None)
    loop_cycles = st[weights, CYCLES + 2] - st[weights, CYCLES]  # slot 5: the loop's end (the pointer kernel only)
    loop = start[weights] + torch.where(st[weights, CYCLES + 2] > 0, loop_cycles / hz * 1e6, float("nan"))
    tail_cycles = st[weights, CYCLES + 3] - st[weights, CYCLES + 2]  # slot 6: exit, in cycles
    tail = torch.where(st[weights, CYCLES + 2] > 0, tail_cycles / hz * 1e6, float("nan"))

    def q(v, p):
        return torch.quantile(v.double(), p).item()

    return {"span": exit_.max().item(), "programs": len(st), "rank": n_rank, "start_p50": q(start, 0.5),
            "start_max": start.max().item(), "loop_p50": q(loop, 0.5), "loop_max": loop.max().item(),
            "exit_p50": q(exit_, 0.5), "exit_max": exit_.max().item(), "tail_p50": q(tail, 0.5),
            "tail_max": tail.max().item(),
            "rank_exit_max": exit_[:n_rank].max().item() if n_rank else float("nan")}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    hz = clock_hz()
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    fmt = get_format("int4")
    rows = []
    print(f"{torch.cuda.get_device_name()}  SM clock {hz / 1e9:.2f} GHz  (us from the first program's entry)")
    print("case               progs  span  start p50/max   loop p50/max   exit p50/max   tail p50/max   rank exit max")
    for name, n, k, ns in SHAPES:
        packed = fmt.random_packed((n, k), device="cuda")
        w = resolve("int4", packed, stacked=False)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        cfg = configs.pick_gemv(1, x.device, x.dtype, True, w)
        a = [torch.randn(16, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in ns]
        b = [torch.randn(ng, 16, device="cuda", dtype=torch.bfloat16) for ng in ns]
        for with_lora in (False, True):
            delta = LoraDelta(a, b, [2.0] * len(ns)) if with_lora else None
            one_run(x, w, cfg, delta, flush, hz)  # compile
            runs = [one_run(x, w, cfg, delta, flush, hz) for _ in range(args.reps)]
            med = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
            label = f"{name}{'+lora' if with_lora else ''}"
            rows.append({"case": label, "config": repr(cfg), **med})
            cols = [f"{med[key]:5.1f}" for key in ("start_p50", "start_max", "loop_p50", "loop_max", "exit_p50",
                                                     "exit_max", "tail_p50", "tail_max", "rank_exit_max")]  # fmt: skip
            print(f"{label:18s} {med['programs']:5.0f} {med['span']:5.1f}  {cols[0]}/{cols[1]}    {cols[2]}/{cols[3]}"
                  f"    {cols[4]}/{cols[5]}    {cols[6]}/{cols[7]}    {cols[8]}")  # fmt: skip
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gemv_timeline.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
