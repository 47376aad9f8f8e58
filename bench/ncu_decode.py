"""Hardware counters of the int4 decode kernels under Nsight Compute, on the GPU machine:

    python bench/ncu_decode.py [--shapes DeepSeek-V3.mlp.down Qwen3-8B.o] [--m 1 8 9 16] [--configs dispatched two]

Runs itself under `ncu --clock-control none` (clocks as in every other bench here) and prints one row per shape, M
and config. Each row holds the kernel's duration, DRAM, L1/TEX and L2 throughput (% of peak), issued and eligible
warps per scheduler, the cycles with no eligible warp, registers, achieved occupancy and the largest stall reasons,
in cycles per issued instruction. Configs: "dispatched" (what kernels.int4_linear runs), and "one", "two", "long-k"
(the mma GEMV's configs._GEMV_MMA, _GEMV_MMA_TWO_ROWTILES and _GEMV_MMA_LONG_K at any M <= 16, as configs._at_rows
serves M rows). Every launch follows an L2 read flush, as in bench/kernels.py. The question it was written for
(bench/RESULTS.md, "Kernels", twenty-fifth session): at 8 rows the mma GEMV runs close to its one-row time, and
from 9 rows it is ~25 % slower, with no variant that touches the activation traffic, the registers or the DRAM
latency (row warps, four row tiles a warp, an L2 prefetch) closing the gap. With $OUT set, ncu's raw CSV is written
there too.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import io
import os
import re
import shutil
import subprocess
import sys

import torch

# Before anything loads transformers: moves this directory (bench/kernels.py) behind the HF `kernels` package.
import orbit_lightning  # noqa: F401

KERNELS = r"regex:_gemv_mma_kernel|_wgmma_int4_kernel"
STALLS = r"regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
SECTIONS = ("SpeedOfLight", "SchedulerStats", "WarpStateStats", "Occupancy", "LaunchStats")
MEMORY_SECTIONS = ("MemoryWorkloadAnalysis", "MemoryWorkloadAnalysis_Tables")
MEMORY_METRICS = r"wavefront|bank|sector|request|hit rate|busy|bandwidth|pipe|shared|L1|L2|lsu|tex"
# (column, ncu's metric name): the detail-page metrics the table prints
COLUMNS = (("us", "Duration"), ("DRAM %", "DRAM Throughput"), ("L1/TEX %", "L1/TEX Cache Throughput"),
           ("L2 %", "L2 Cache Throughput"), ("issued", "Issued Warp Per Scheduler"),
           ("eligible", "Eligible Warps Per Scheduler"), ("none elig %", "No Eligible"),
           ("regs", "Registers Per Thread"), ("occup %", "Achieved Occupancy"))  # fmt: skip
_TIME_UNITS = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}


def _bench_kernels():
    path = os.path.join(os.path.dirname(__file__), "kernels.py")
    spec = importlib.util.spec_from_file_location("bench_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _layers() -> dict[str, tuple[int, int]]:
    """bench/kernels.py's dense shapes: "model.layer" -> (N, K)."""
    dense = _bench_kernels().DENSE
    return {f"{model}.{layer}": (n, k) for model, rows in dense.items() for layer, n, k in rows}


def _tickets(count: int) -> torch.Tensor:
    from orbit_lightning.kernels import gemm

    return gemm._tickets(torch.device("cuda", torch.cuda.current_device()), count)


def cases(shapes: list[str], ms: list[int], names: list[str]) -> list[tuple[str, int, str]]:
    """(shape, M, config) in launch order; the mma configs only where M <= 16."""
    return [(s, m, c) for s in shapes for m in ms for c in names if c == "dispatched" or m <= 16]


def run_cases(todo: list[tuple[str, int, str]]) -> None:
    """The child: every case once to compile (ncu skips these launches), then once more behind a flush."""
    from orbit_lightning.kernels import configs, gemv
    from orbit_lightning.kernels.formats import resolve

    from orbit_lightning import kernels
    from orbit_lightning.quant.formats import get_format

    bk = _bench_kernels()
    layers = _layers()
    mma = {"one": configs._GEMV_MMA, "two": configs._GEMV_MMA_TWO_ROWTILES, "long-k": configs._GEMV_MMA_LONG_K}
    fmt = get_format("int4")
    calls = []
    for shape, m, name in todo:
        n, k = layers[shape]
        packed = fmt.random_packed((n, k), device="cuda")
        x = torch.randn(m, k, device="cuda").bfloat16()
        if name == "dispatched":
            calls.append(lambda x=x, p=packed: kernels.int4_linear(x, p))
        else:
            w = resolve("int4", packed, stacked=False)
            out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
            cfg = configs._at_rows(mma[name], m)  # as the dispatch would serve m rows
            calls.append(lambda x=x, w=w, o=out, c=cfg: gemv.gemv(x, w, o, c, _tickets, True))
    bk._FLUSH.append(torch.ones(256 << 20, dtype=torch.int8, device="cuda"))
    for call in calls:  # compile and allocate: the launches ncu skips
        call()
    torch.cuda.synchronize()
    for call in calls:
        bk._flush_l2()
        call()
    torch.cuda.synchronize()


def parse(text: str) -> list[dict[str, tuple[str, str]]]:
    """ncu's `--csv --page details` rows as one dict per profiled launch, in launch order: metric name -> (unit,
    value). Lines that are not CSV rows (the program's own output, ncu's ==PROF== notes) are skipped."""
    rows = [line for line in text.splitlines() if line.startswith('"')]
    launches: dict[str, dict[str, tuple[str, str]]] = {}
    header = None
    for rec in csv.reader(io.StringIO("\n".join(rows))):
        if rec and rec[0] == "ID":
            header = {name: i for i, name in enumerate(rec)}
            continue
        # (metric rows end after their value: the rule columns are present only on the detail sections' rows)
        if header is None or len(rec) <= header["Metric Value"]:
            continue
        launch = launches.setdefault(rec[header["ID"]], {"Kernel Name": ("", rec[header["Kernel Name"]])})
        launch[rec[header["Metric Name"]]] = (rec[header["Metric Unit"]], rec[header["Metric Value"]])
    return [launches[i] for i in sorted(launches, key=int)]


def number(unit_value: tuple[str, str] | None) -> float:
    """A metric's value as a float (durations in microseconds); nan where it is missing."""
    if unit_value is None:
        return float("nan")
    unit, value = unit_value
    try:
        v = float(value.replace(",", ""))
    except ValueError:
        return float("nan")
    return v * _TIME_UNITS.get(unit, 1.0)


def stalls(launch: dict[str, tuple[str, str]], top: int = 4) -> str:
    """The `top` largest stall reasons, cycles per issued instruction."""
    pre, post = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"
    found = [(number(v), name[len(pre):-len(post)]) for name, v in launch.items()
             if name.startswith(pre) and name.endswith(post)]  # fmt: skip
    found = sorted((v, name) for v, name in found if v == v and v > 0)[::-1][:top]
    return ", ".join(f"{name} {v:.2f}" for v, name in found)


def table(todo: list[tuple[str, int, str]], launches: list[dict]) -> str:
    lines = [f"{'shape':26} {'M':>3} {'config':10} " + " ".join(f"{c:>11}" for c, _ in COLUMNS) + "  stalls"]
    for (shape, m, name), launch in zip(todo, launches, strict=False):
        cells = " ".join(f"{number(launch.get(metric)):11.2f}" for _, metric in COLUMNS)
        lines.append(f"{shape:26} {m:3d} {name:10} {cells}  {stalls(launch)}")
    if len(launches) != len(todo):
        lines.append(f"(ncu profiled {len(launches)} launches for {len(todo)} cases: rows may be misaligned)")
    return "\n".join(lines)


def memory_table(todo: list[tuple[str, int, str]], launches: list[dict]) -> str:
    """Every memory-section metric (MEMORY_METRICS) of each launch, one line per metric: which unit (L1 wavefronts
    of the global and shared pipes, bank conflicts, L2) a kernel runs against."""
    lines = []
    for (shape, m, name), launch in zip(todo, launches, strict=False):
        lines.append(f"== {shape} M = {m} {name}")
        lines += [f"   {metric:60} {unit:>10} {value:>14}" for metric, (unit, value) in launch.items()
                  if re.search(MEMORY_METRICS, metric, re.IGNORECASE)]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["DeepSeek-V3.mlp.down", "Qwen3-8B.gate_up", "Qwen3-8B.o"])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8, 9, 16])
    ap.add_argument("--configs", nargs="+", default=["dispatched", "one", "two"],
                    choices=["dispatched", "one", "two", "long-k"])
    ap.add_argument("--memory", action="store_true",
                    help="also Nsight's memory workload sections: per launch, the L1 / shared / L2 metrics they hold")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    layers = _layers()
    unknown = [s for s in args.shapes if s not in layers]
    if unknown:
        sys.exit(f"bench/ncu_decode.py: unknown shape(s) {unknown}; bench/kernels.py's are: {', '.join(layers)}")
    todo = cases(args.shapes, args.m, args.configs)
    if args.child:
        run_cases(todo)
        return
    if not torch.cuda.is_available():
        sys.exit("bench/ncu_decode.py needs a CUDA GPU")
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    if not os.path.exists(ncu):
        sys.exit("bench/ncu_decode.py needs Nsight Compute's ncu (not found on PATH or in /usr/local/cuda/bin)")
    cmd = [ncu, "--clock-control", "none", "--kernel-name", KERNELS, "--launch-skip", str(len(todo)), "--csv",
           "--page", "details", "--metrics", STALLS]  # fmt: skip
    for section in SECTIONS + (MEMORY_SECTIONS if args.memory else ()):
        cmd += ["--section", section]
    cmd += [sys.executable, os.path.abspath(__file__), "--child", "--shapes", *args.shapes, "--m",
            *map(str, args.m), "--configs", *args.configs]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "ncu_decode.csv"), "w") as f:
            f.write(done.stdout)
    launches = parse(done.stdout)
    if done.returncode or not launches:
        sys.exit(f"ncu failed (exit {done.returncode}):\n{done.stderr[-3000:]}\n{done.stdout[-2000:]}")
    print(table(todo, launches))
    if args.memory:
        print(memory_table(todo, launches))


if __name__ == "__main__":
    main()
