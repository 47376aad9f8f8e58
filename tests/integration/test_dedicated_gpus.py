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
    assert torch.cuda.current_device() == 0


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_engine_on_second_gpu_leaves_later_captures_on_the_first_intact():
    """An engine on cuda:1 captures its decode graphs on its own stream. torch.cuda.graph's default capture
    stream is made once, on the device current at first use: had the engine's capture created it on cuda:1, this
    later capture on cuda:0 would record an empty graph and its Triton launch would fail."""
    from orbit_lightning import kernels, load_model
    from orbit_lightning.rollout import RolloutEngine, SamplingParams

    model = load_model("tiny-qwen3", dtype=torch.bfloat16, quant="int4", device="cuda:1")
    engine = RolloutEngine(model, max_batch_size=2, max_model_len=64)
    out = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 4 and engine.stats()["graphs_captured"] >= 1
    x, w = torch.randn(4, 64, device="cuda:0"), torch.rand(64, device="cuda:0")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = kernels.rms_norm(x, w)
    x.mul_(2)
    graph.replay()
    torch.testing.assert_close(y, kernels.rms_norm(x, w))
