"""Where a decode step's GPU idle time goes, from a Chrome trace of `bench/rollout.py --profile N --trace DIR`.

    python bench/trace_gaps.py DIR/b1_steps8.json [--min-gap-us 20]

Lists every stretch of at least --min-gap-us in which no GPU kernel, copy or memset runs, with the GPU work on
either side and the host calls (CUDA runtime, aten ops) that ran during it, then totals the idle time by what the
GPU waited for: a graph replay's launch, a copy, the host reading results, and so on.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
HOST_CATS = {"cuda_runtime", "cuda_driver", "cpu_op"}


def load_events(path: str) -> tuple[list[dict], list[dict]]:
    """(GPU events, host events) of a torch.profiler Chrome trace, each sorted by start; times in µs."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    timed = [e for e in events if e.get("ph") == "X" and "dur" in e]
    gpu = sorted((e for e in timed if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    host = sorted((e for e in timed if e.get("cat") in HOST_CATS), key=lambda e: e["ts"])
    return gpu, host


def idle_gaps(gpu: list[dict], min_gap_us: float) -> list[tuple[float, float, dict, dict]]:
    """(start, end, GPU event before, GPU event after) of each idle stretch of at least min_gap_us."""
    gaps, end, last = [], None, None
    for e in gpu:
        if end is not None and e["ts"] - end >= min_gap_us:
            gaps.append((end, e["ts"], last, e))
        if end is None or e["ts"] + e["dur"] > end:
            end, last = e["ts"] + e["dur"], e
    return gaps


def host_during(host: list[dict], start: float, end: float) -> list[dict]:
    """Host events that overlap [start, end]."""
    return [e for e in host if e["ts"] < end and e["ts"] + e["dur"] > start]


def cause(host_calls: list[dict]) -> str:
    """What the GPU most likely waited for, from the host calls in the gap: the longest runtime call, else the
    longest aten op, else 'host (no CUDA call)'."""
    for cats in ({"cuda_runtime", "cuda_driver"}, {"cpu_op"}):
        calls = [e for e in host_calls if e.get("cat") in cats]
        if calls:
            return max(calls, key=lambda e: e["dur"])["name"]
    return "host (no CUDA call)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--min-gap-us", type=float, default=20.0)
    ap.add_argument("--show", type=int, default=12, help="gaps to list one by one (the longest)")
    args = ap.parse_args()
    gpu, host = load_events(args.trace)
    gaps = idle_gaps(gpu, args.min_gap_us)
    span = gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"] if gpu else 0.0
    idle = sum(b - a for a, b, _, _ in gaps)
    print(f"{len(gpu)} GPU events over {span:.0f} us; {len(gaps)} gaps >= {args.min_gap_us:g} us, {idle:.0f} us idle")
    by_cause: dict[str, list[float]] = defaultdict(list)
    rows = []
    for a, b, before, after in gaps:
        calls = host_during(host, a, b)
        by_cause[cause(calls)].append(b - a)
        rows.append((b - a, before["name"], after["name"], calls))
    for gap, before, after, calls in sorted(rows, key=lambda r: -r[0])[: args.show]:
        names = ", ".join(sorted({e["name"][:40] for e in calls if e.get("cat") != "cpu_op"}))[:150]
        print(f"{gap:8.1f} us  after {before[:45]:45s}  before {after[:45]:45s}  host: {names}")
    print("idle by the host call the GPU waited on:")
    for name, durs in sorted(by_cause.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {sum(durs):8.1f} us in {len(durs):3d} gaps  {name[:80]}")


if __name__ == "__main__":
    main()
