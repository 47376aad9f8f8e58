"""DAPO dynamic sampling in a real run: all-equal groups are dropped and refilled; resume stays exact."""

import csv

from orbit_lightning.cli import compose
from orbit_lightning.train import run_train
from tests.integration.cli_runs import SHIPPED


def test_dynamic_sampling_keeps_only_informative_groups(tmp_path):
    cfg, _ = compose([*SHIPPED, "algo=dapo", "algo.max_sampling_rounds=4", "trainer.max_steps=3",
                      f"trainer.output_dir={tmp_path}"])
    run_train(cfg)
    with open(tmp_path / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("dynamic_sampling/rounds")]
    assert len(rows) == 3
    assert all(1 <= float(r["dynamic_sampling/rounds"]) <= 4 for r in rows)
    assert any(float(r["dynamic_sampling/kept_groups"]) > 0 for r in rows)
