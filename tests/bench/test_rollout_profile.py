"""bench/rollout.py's split of a profiled timeline (the device run relies on it to tell launch gaps from host work)."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("bench_rollout", Path(__file__).parents[2] / "bench" / "rollout.py")
rollout = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rollout)


def test_timeline_split_counts_overlaps_once_and_sorts_gaps_by_length():
    # Two kernels overlapping (PDL), a 3 us launch gap, a nested interval, then 100 us of host time and a copy.
    spans = [(10.0, 20.0), (0.0, 8.0), (6.0, 9.0), (12.0, 15.0), (120.0, 125.0)]
    split = rollout.timeline_split(spans)
    assert split["busy"] == pytest.approx(9.0 + 10.0 + 5.0)
    assert split["short_gaps"] == pytest.approx(1.0)
    assert split["long_gaps"] == pytest.approx(100.0) and split["n_long"] == 1
    first, last = min(s for s, _ in spans), max(e for _, e in spans)
    assert sum(split[k] for k in ("busy", "short_gaps", "long_gaps")) == pytest.approx(last - first)


def test_timeline_split_of_nothing_is_zero():
    assert rollout.timeline_split([]) == dict(busy=0.0, short_gaps=0.0, long_gaps=0.0, n_long=0)
