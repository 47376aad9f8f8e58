"""Summarize a run directory's metrics.csv: eval curve, median time and peak memory per phase.

    python bench/summarize_run.py runs/default
"""

import statistics
import sys
from pathlib import Path

from orbit_lightning.report import read_metrics

if __name__ == "__main__":
    series = read_metrics(Path(sys.argv[1]) / "metrics.csv")
    for key in ("eval/accuracy", "eval/pass@8"):
        print(key, [(int(s), round(v, 3)) for s, v in series.get(key, [])])
    phases = sorted(k[5:] for k in series if k.startswith("time/"))
    total = 0.0
    for p in phases:
        t = statistics.median(v for _, v in series[f"time/{p}"])
        total += t
        peak = max(v for _, v in series.get(f"memory/{p}_peak_bytes", [(0, 0)]))
        print(f"{p:<14} median {t * 1e3:8.1f} ms   peak {peak / 2**20:9.1f} MiB")
    print(f"{'sum of phases':<14} median {total * 1e3:8.1f} ms per RL step")
    d = [v for _, v in series.get("rollout/logprob_diff_abs_mean", [])]
    if d:
        print(f"train-rollout |dlogprob| mean over steps {statistics.mean(d):.2e}, "
              f"max {max(v for _, v in series['rollout/logprob_diff_abs_max']):.2e}")
