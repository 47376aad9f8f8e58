"""bench/trace_gaps.py: idle stretches of a Chrome trace and the host call each one waited on."""

import importlib.util
import json
from pathlib import Path

_spec = importlib.util.spec_from_file_location("trace_gaps", Path(__file__).parents[2] / "bench" / "trace_gaps.py")
trace_gaps = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(trace_gaps)


def _event(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_gaps_are_found_between_overlapping_kernels_and_blamed_on_the_longest_runtime_call(tmp_path):
    events = [
        _event("kernel", "gemv", 0, 10), _event("kernel", "rope", 8, 4),  # overlap (PDL): no gap
        _event("kernel", "attn", 15, 5),  # a 3 us launch gap: under the threshold
        _event("gpu_memcpy", "Memcpy DtoH", 100, 2),  # 80 us idle before it
        _event("cuda_runtime", "cudaGraphLaunch", 30, 60), _event("cuda_runtime", "cudaStreamSynchronize", 25, 3),
        _event("cpu_op", "aten::copy_", 20, 70), _event("cpu_op", "outside", 200, 5),
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 50},  # not a duration event: ignored
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    gpu, host = trace_gaps.load_events(str(path))
    assert [e["name"] for e in gpu] == ["gemv", "rope", "attn", "Memcpy DtoH"]
    gaps = trace_gaps.idle_gaps(gpu, 20.0)
    assert [(a, b, before["name"], after["name"]) for a, b, before, after in gaps] == [(20, 100, "attn", "Memcpy DtoH")]
    calls = trace_gaps.host_during(host, 20, 100)
    assert {e["name"] for e in calls} == {"cudaGraphLaunch", "cudaStreamSynchronize", "aten::copy_"}
    assert trace_gaps.cause(calls) == "cudaGraphLaunch"
    assert trace_gaps.cause([e for e in calls if e["cat"] == "cpu_op"]) == "aten::copy_"
    assert trace_gaps.cause([]) == "host (no CUDA call)"
