"""bench/ncu_decode.py: the cases it launches, and its reading of Nsight Compute's `--csv --page details` output."""

import importlib.util
import math
from pathlib import Path

_spec = importlib.util.spec_from_file_location("ncu_decode", Path(__file__).parents[2] / "bench" / "ncu_decode.py")
ncu_decode = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ncu_decode)

_HEAD = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
         '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')  # fmt: skip


def _row(launch, kernel, section, name, unit, value):
    return (f'"{launch}","7","python3","127.0.0.1","{kernel}","1","7","(256, 1, 1)","(448, 1, 1)","0","9.0",'
            f'"{section}","{name}","{unit}","{value}"')  # fmt: skip


def test_cases_leave_the_mma_configs_out_past_16_rows():
    todo = ncu_decode.cases(["Qwen3-8B.o"], [8, 32], ["dispatched", "two"])
    assert todo == [("Qwen3-8B.o", 8, "dispatched"), ("Qwen3-8B.o", 8, "two"), ("Qwen3-8B.o", 32, "dispatched")]


def test_details_csv_becomes_one_row_per_launch_in_order():
    stall = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
    text = "\n".join([
        "==PROF== Connected to process 7",  # ncu's notes and the program's output are not CSV rows
        _HEAD,
        _row(10, "_gemv_mma_kernel", "GPU Speed Of Light Throughput", "Duration", "usecond", "28.51"),
        _row(10, "_gemv_mma_kernel", "GPU Speed Of Light Throughput", "DRAM Throughput", "%", "61.2"),
        _row(10, "_gemv_mma_kernel", "Scheduler Statistics", "No Eligible", "%", "55.10"),
        _row(10, "_gemv_mma_kernel", "Command line profiler metrics", stall.format("long_scoreboard"), "", "3.5"),
        _row(10, "_gemv_mma_kernel", "Command line profiler metrics", stall.format("barrier"), "", "0.25"),
        _row(10, "_gemv_mma_kernel", "Command line profiler metrics", stall.format("wait"), "", "1,204.5"),
        _row(10, "_gemv_mma_kernel", "Command line profiler metrics", stall.format("sleeping"), "", "0"),
        _row(9, "_wgmma_int4_kernel", "GPU Speed Of Light Throughput", "Duration", "msecond", "0.0384"),
        "some program output",
    ])
    first, second = ncu_decode.parse(text)  # ordered by launch ID, not by position in the text
    assert first["Kernel Name"][1] == "_wgmma_int4_kernel" and second["Kernel Name"][1] == "_gemv_mma_kernel"
    assert abs(ncu_decode.number(first["Duration"]) - 38.4) < 1e-9  # milliseconds read as microseconds
    assert ncu_decode.number(second["DRAM Throughput"]) == 61.2
    assert math.isnan(ncu_decode.number(second.get("Registers Per Thread")))  # not collected: nan, not an error
    assert ncu_decode.stalls(second, top=2) == "wait 1204.50, long_scoreboard 3.50"  # zeros dropped, largest first
    table = ncu_decode.table([("DeepSeek-V3.mlp.down", 16, "dispatched"), ("DeepSeek-V3.mlp.down", 8, "one")],
                             [first, second])  # fmt: skip
    assert "38.40" in table.splitlines()[1] and "28.51" in table.splitlines()[2]
    assert "misaligned" in ncu_decode.table([("a", 1, "one")], [first, second])


def test_memory_table_keeps_the_memory_metrics_of_each_launch():
    launch = {"Kernel Name": ("", "_gemv_mma_kernel"), "Duration": ("usecond", "9.1"),
              "L1/TEX Hit Rate": ("%", "12.5"), "Shared Load Bank Conflicts": ("", "0"),
              "Achieved Occupancy": ("%", "31")}  # fmt: skip
    lines = ncu_decode.memory_table([("Qwen3-8B.o", 16, "dispatched")], [launch]).splitlines()
    assert lines[0] == "== Qwen3-8B.o M = 16 dispatched"
    kept = {line.split()[0] for line in lines[1:]}
    assert kept == {"L1/TEX", "Shared"}  # the hit rate and the bank conflicts; not the duration or the occupancy
