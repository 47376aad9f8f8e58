"""Eval: greedy accuracy and pass@k on the eval split every N RL steps (and before the first), with a sample
table written as JSONL into the run directory."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L

from orbit_lightning.atomic_write import atomic_write


def _row_step(line: str) -> int | None:
    """The RL step of a sample-table row, None for a torn one (a run killed mid-write)."""
    try:
        return int(json.loads(line)["rl_step"])
    except (ValueError, KeyError, TypeError):
        return None


class EvalCallback(L.Callback):
    def __init__(self, items: list[dict], every_n_steps: int = 10, k: int = 8, max_items: int | None = None,
                 output_dir: str | None = None):
        if not items:
            raise ValueError("EvalCallback needs a non-empty eval split")
        self.items = items[:max_items] if max_items else items
        self.every_n_steps, self.k = every_n_steps, k
        self.output_dir = output_dir
        self.history: list[dict[str, float]] = []

    def _run(self, trainer: L.Trainer, pl_module) -> None:
        metrics, table = pl_module.evaluate(self.items, self.k)
        metrics = {**metrics, "rl_step": float(pl_module.rl_step)}
        self.history.append(metrics)
        for logger in trainer.loggers:
            logger.log_metrics({k: v for k, v in metrics.items() if k != "rl_step"}, step=pl_module.rl_step)
        pl_module.last_eval = metrics  # shown on the progress bar by the module
        out = self._samples_path(trainer)
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a") as f:
            for row in table[:16]:
                f.write(json.dumps({"rl_step": pl_module.rl_step, **row}) + "\n")

    def _samples_path(self, trainer: L.Trainer) -> Path:
        return Path(self.output_dir or trainer.default_root_dir) / "eval_samples.jsonl"

    def on_train_start(self, trainer: L.Trainer, pl_module) -> None:
        # A new run starts the sample table afresh; a resumed one keeps the rows of the steps its checkpoint holds
        # (those the stopped run wrote after it are written again).
        out = self._samples_path(trainer)
        if out.is_file():
            kept = [(line, _row_step(line)) for line in out.read_text().splitlines()] if pl_module.rl_step else []
            rows = [line for line, step in kept if step is not None and step <= pl_module.rl_step]
            atomic_write(out, lambda tmp: Path(tmp).write_text("".join(row + "\n" for row in rows)))
        # Before the first step only: a resumed run evaluates where an uninterrupted one would, so its history and
        # metrics.csv match that run's.
        if pl_module.rl_step == 0 and not self.history:
            self._run(trainer, pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        last = trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps
        if pl_module.rl_step % self.every_n_steps == 0 or last:
            self._run(trainer, pl_module)

    def state_dict(self) -> dict:
        return {"history": self.history}

    def load_state_dict(self, state_dict: dict) -> None:
        self.history = state_dict.get("history", [])
