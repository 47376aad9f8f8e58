"""metrics.csv across a resume: rows of checkpointed RL steps kept, later ones dropped, a lost row named."""

import csv
import logging

from orbit_lightning.csv_log import ResumedCSVLogger, keep_rows_until

# Lightning's sparse rows: training rows carry rl_step (their step counts from 0), eval rows step = RL step.
COLUMNS = ["eval/accuracy", "loss/policy", "rl_step", "step"]
ROWS = [{"eval/accuracy": "0.1", "step": "0"}, {"loss/policy": "0.5", "rl_step": "1", "step": "0"},
        {"loss/policy": "0.4", "rl_step": "2", "step": "1"}, {"eval/accuracy": "0.3", "step": "2"},
        {"loss/policy": "0.3", "rl_step": "3", "step": "2"}]


def write(path, rows):
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)


def read(path):
    with path.open(newline="") as f:
        return [{k: v for k, v in r.items() if v} for r in csv.DictReader(f)]


def test_keeps_rows_up_to_the_checkpointed_step(tmp_path, caplog):
    path = tmp_path / "metrics.csv"
    write(path, ROWS)
    with caplog.at_level(logging.WARNING):
        assert keep_rows_until(path, 2) == COLUMNS
    assert read(path) == ROWS[:4] and not caplog.records


def test_names_the_steps_whose_rows_a_kill_lost(tmp_path, caplog):
    path = tmp_path / "metrics.csv"
    write(path, ROWS[:2])
    with caplog.at_level(logging.WARNING):
        keep_rows_until(path, 3)
    assert "no rows for RL steps 2-3" in caplog.text


def test_a_resumed_logger_appends_and_a_new_run_starts_afresh(tmp_path):
    write(tmp_path / "metrics.csv", ROWS)
    logger = ResumedCSVLogger(tmp_path, last_rl_step=1)
    logger.log_metrics({"loss/policy": 0.25, "rl_step": 2.0}, step=1)
    logger.save()
    assert read(tmp_path / "metrics.csv") == [*ROWS[:2], {"loss/policy": "0.25", "rl_step": "2.0", "step": "1"}]

    fresh = ResumedCSVLogger(tmp_path, last_rl_step=None)
    fresh.log_metrics({"loss/policy": 0.5}, step=0)
    fresh.save()
    assert read(tmp_path / "metrics.csv") == [{"loss/policy": "0.5", "step": "0"}]
