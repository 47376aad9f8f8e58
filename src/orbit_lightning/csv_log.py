"""The run's metrics.csv across a resume.

Lightning's CSV writer deletes an existing metrics.csv when it starts, so a resumed run (or one that failed to
resume) lost every row logged before. Here a resumed run keeps the rows of the RL steps its checkpoint holds and
appends to them; rows of later steps (logged after that checkpoint was written, by the run that crashed) are dropped,
because the resumed run logs those steps again.

Lightning writes a step's checkpoint (in on_train_batch_end) a few milliseconds before it flushes that step's row, so
a kill in between loses the row; the resumed run says so, naming the steps.
"""

from __future__ import annotations

import csv
import logging
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter

from .atomic_write import atomic_write

log = logging.getLogger(__name__)


def row_rl_step(row: dict[str, str]) -> float:
    """The RL step a row belongs to: training rows carry `rl_step` (their `step` counts optimizer steps from 0),
    evaluation rows are logged at step = the RL step they evaluate."""
    return float(row.get("rl_step") or row["step"])


def keep_rows_until(path: Path, last_rl_step: int) -> list[str]:
    """Rewrite metrics.csv with only the rows of RL steps <= last_rl_step; returns its columns."""
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        columns = list(reader.fieldnames or [])
        rows = [r for r in reader if r.get("step") and row_rl_step(r) <= last_rl_step]
    trained = max((float(r["rl_step"]) for r in rows if r.get("rl_step")), default=0)  # (eval rows come earlier)
    if trained < last_rl_step:
        log.warning("%s has no rows for RL steps %d-%d: the run stopped after checkpointing them but before their "
                    "rows were written", path, int(trained) + 1, last_rl_step)

    def write(tmp: str) -> None:
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows(rows)

    atomic_write(path, write)  # a kill mid-rewrite leaves the old file whole
    return columns


class ResumedCSVLogger(CSVLogger):
    """CSVLogger in `run_dir` (no version subfolder) that continues metrics.csv from `last_rl_step`, or starts it
    afresh when that is None (a new run in the directory)."""

    def __init__(self, run_dir: Path, last_rl_step: int | None):
        # Rows are appended to the file every step (Lightning's default is every 100): an RL step takes far longer
        # than the append, and rows held in memory die with a killed run, checkpointed steps' rows included.
        super().__init__(run_dir, name="", version="", flush_logs_every_n_steps=1)
        self.last_rl_step = last_rl_step

    @property
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            last_rl_step = self.last_rl_step

            class Writer(ExperimentWriter):
                def _check_log_dir_exists(self) -> None:
                    path = Path(self.metrics_file_path)
                    if last_rl_step is None or not path.is_file():
                        return super()._check_log_dir_exists()
                    # (the writer rewrites the file with a new header when new columns come; it must know the old)
                    self.metrics_keys = sorted(keep_rows_until(path, last_rl_step))

            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = Writer(log_dir=self.log_dir)
        return self._experiment
