"""The end-of-run report: a PNG of reward, eval accuracy, pass@k, |Δlogprob| and memory over RL steps, plus the
final numbers (report.json), both read back from the run's metrics.csv."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path


def read_metrics(csv_path: Path) -> dict[str, list[tuple[float, float]]]:
    """metric -> [(rl_step, value)] from Lightning's CSVLogger file (sparse rows)."""
    series: dict[str, list[tuple[float, float]]] = {}
    with open(csv_path) as f:
        for row in csv.DictReader(f):
            step = float(row.get("rl_step") or row.get("step") or 0)
            for k, v in row.items():
                if k in ("step", "epoch") or v in ("", None):
                    continue
                try:
                    val = float(v)
                except ValueError:
                    continue
                if math.isfinite(val):
                    series.setdefault(k, []).append((step, val))
    return series


def write_report(run_dir: Path, eval_history: list[dict[str, float]]) -> tuple[Path, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = read_metrics(run_dir / "metrics.csv")
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))

    def plot(ax, key, title):
        pts = series.get(key, [])
        ax.plot([p[0] for p in pts], [p[1] for p in pts], ".-")
        ax.set_title(title)

    plot(axes[0], "reward/mean", "reward")
    for key in sorted({k for h in eval_history for k in h if k.startswith("eval/")}):
        pts = [(h["rl_step"], h[key]) for h in eval_history if key in h]
        axes[1].plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=key)
    axes[1].set_title("eval (greedy accuracy, pass@k)")
    axes[1].legend()
    plot(axes[2], "rollout/logprob_diff_abs_mean", "|Δlogprob| train vs rollout")
    plot(axes[3], "memory/train_peak_bytes", "peak memory, train phase (bytes)")
    for ax in axes:
        ax.set_xlabel("rl_step")
    fig.tight_layout()
    png = run_dir / "report.png"
    fig.savefig(png, dpi=80)
    plt.close(fig)

    final = {k: v[-1][1] for k, v in series.items() if v}
    summary = {"first_eval": eval_history[0] if eval_history else None,
               "last_eval": eval_history[-1] if eval_history else None,
               "final_metrics": final}
    js = run_dir / "report.json"
    js.write_text(json.dumps(summary, indent=2))
    return png, js
