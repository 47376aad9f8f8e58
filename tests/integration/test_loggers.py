"""Lightning's loggers behind `logger=`: CSV (default), TensorBoard and W&B offline all receive the metrics."""

import pytest

from orbit_lightning.cli import compose
from orbit_lightning.train import run_train
from tests.integration.cli_runs import TINY


@pytest.mark.parametrize("kind,artifact", [("tensorboard", "events.out.tfevents.*"), ("wandb", "wandb/offline-run-*")])
def test_logger_backends_write_offline(kind, artifact, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    cfg, _ = compose([*TINY, f"logger={kind}", "trainer.max_steps=1", f"trainer.output_dir={tmp_path}"])
    run_train(cfg)
    assert list(tmp_path.rglob(artifact)), sorted(p.name for p in tmp_path.rglob("*"))[:20]
