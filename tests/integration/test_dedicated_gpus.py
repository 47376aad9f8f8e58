"""The dedicated-rollout strategy on two GPUs: the engine decodes on cuda:1 with its own copy of the packed base,
the trainer trains on cuda:0, and only the adapter crosses between them after every RL step.

Marked `gpu`; it needs two CUDA devices (the nvidia-h200-x2 machine) and skips otherwise. In batch-invariant mode
the two GPUs run the same kernels on the same numbers, so the train/rollout log-prob gap must be exactly 0 even
though the engine's model is a different copy on a different device: a wrong or late adapter push would show.
"""

import csv

import pytest
import torch

from orbit_lightning.cli import compose
from orbit_lightning.train import run_train
from tests.integration.cli_runs import TINY


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_dedicated_rollout_gpu_pushes_every_step_and_matches_bitwise(tmp_path):
    cfg, _ = compose([*TINY, "model.device=cuda:0", "strategy=dedicated", "strategy.rollout_device=cuda:1",
                      "rollout.deterministic=true", "trainer.max_steps=3", "trainer.eval_every=0",
                      f"trainer.output_dir={tmp_path}"])
    run_train(cfg)
    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    gaps = [float(r["rollout/logprob_diff_abs_max"]) for r in rows if r.get("rollout/logprob_diff_abs_max")]
    versions = [float(r["adapter/version"]) for r in rows if r.get("adapter/version")]
    assert len(gaps) == 3 and all(g == 0.0 for g in gaps)
    assert versions == [1.0, 2.0, 3.0]  # pushed after every step, lag 0
