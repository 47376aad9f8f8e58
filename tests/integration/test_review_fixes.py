"""Regressions found in review: dedicated engine placement, eval with rejected prompts, optimizer-step cadence."""

import logging

import lightning as L
import peft
import pytest
import torch

from orbit_lightning import add_adapter, load_model
from orbit_lightning.checkpoint_io import CheckpointSteps
from orbit_lightning.cli import compose
from orbit_lightning.data.tokenizer import CharTokenizer
from orbit_lightning.module import RLModule
from orbit_lightning.rewards import RewardRunner
from orbit_lightning.rl.config import RolloutConfig
from orbit_lightning.strategies import DedicatedRolloutStrategy
from orbit_lightning.train import optimizer_step_budget, run_train
from tests.integration.cli_runs import SHIPPED, TINY


def _tiny(device="cpu"):
    m = load_model("tiny-qwen3", dtype=torch.float32, device=device, vocab_size=47, eos_token_id=2)
    add_adapter(m, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    return m


def _items(n, length=3):
    return [{"prompt_ids": [1] + [5 + i % 10] * length, "prompt": "1+1=", "answer": "2", "metadata": {},
             "index": i} for i in range(n)]


def test_dedicated_strategy_builds_its_own_engine_model():
    module = RLModule(_tiny(), CharTokenizer(), rewards=RewardRunner([("arithmetic_exact", 1.0)]),
                      rollout=RolloutConfig(group_size=2, max_new_tokens=2))
    strategy = DedicatedRolloutStrategy(torch.device("cpu"), torch.device("cpu", 1), lambda d: _tiny())
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader([_items(2)], batch_size=None,
                                                                      collate_fn=lambda b: b))
    assert module.engine is not None and module.engine.model is not module.model


def test_eval_counts_a_rejected_prompt_as_wrong():
    module = RLModule(_tiny(), CharTokenizer(), rewards=RewardRunner([("arithmetic_exact", 1.0)]),
                      rollout=RolloutConfig(group_size=2, max_new_tokens=2))
    module.engine = module.build_engine()
    module.engine.max_model_len = 64  # the last prompt (201 tokens) cannot fit
    items = _items(3) + _items(1, length=200)
    metrics, table = module.evaluate(items, k=2)
    assert metrics["eval/rejected"] == 1.0 and len(table) == 4 and not table[-1]["correct"]


def test_every_rl_step_makes_exactly_minibatches_optimizer_steps(tmp_path):
    # 2 prompts x 2 samples = 4 rows split into 3 minibatches: tensor_split keeps 3 optimizer steps per RL step.
    cfg, _ = compose([*SHIPPED, "data.prompts_per_step=2", "rollout.group_size=2", "algo.minibatches=3",
                      "trainer.max_steps=2", "trainer.checkpoint_every=1", f"trainer.output_dir={tmp_path}"])
    run_train(cfg)
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 6 and ckpt["orbit"]["rl_step"] == 2


def test_a_resume_with_other_minibatches_still_counts_rl_steps(tmp_path, caplog):
    """2 RL steps at 3 optimizer steps each, resumed at 4 per RL step with trainer.max_steps=3: exactly one more RL
    step runs (6 + 4 optimizer steps; Lightning's max_steps of 3 x 4 ran two, to RL step 4, before the checkpoint
    recorded its own count), the log says what changed, and periodic checkpoints still come every RL step
    (Lightning's ModelCheckpoint, which counted optimizer steps, wrote none after such a resume: 10 is not a
    multiple of 4)."""
    args = [*SHIPPED, "data.prompts_per_step=2", "rollout.group_size=2", "trainer.checkpoint_every=1",
            f"trainer.output_dir={tmp_path}"]
    run_train(compose([*args, "algo.minibatches=3", "trainer.max_steps=2"])[0])
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.ckpt", "rl_step=2.ckpt"]
    caplog.set_level(logging.INFO)
    run_train(compose([*args, "algo.minibatches=4", "trainer.max_steps=3", "trainer.resume=auto"])[0])
    assert "written at 3 optimizer steps per RL step, this run takes 4" in caplog.text
    assert "not at an RL-step boundary" not in caplog.text
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.ckpt", "rl_step=3.ckpt"]  # the earlier ones: gone
    assert (ckpts / "last.ckpt").samefile(ckpts / "rl_step=3.ckpt")  # one file, two names
    last = torch.load(ckpts / "last.ckpt", weights_only=False)
    assert last["global_step"] == 10 and last["orbit"]["rl_step"] == 3
    assert last["orbit"]["optimizer_steps_per_rl_step"] == 4


def test_the_optimizer_step_budget_counts_rl_steps_from_the_checkpoint():
    fresh = optimizer_step_budget(5, 3)
    assert fresh == 15
    assert optimizer_step_budget(5, 3, CheckpointSteps(6, 2, 3)) == 15  # a boundary, same count: unchanged
    assert optimizer_step_budget(5, 4, CheckpointSteps(6, 2, 3)) == 18  # 3 more RL steps of 4
    assert optimizer_step_budget(5, 3, CheckpointSteps(7, 2, 3)) == 16  # mid-step: RL step 3 runs whole, from 7
    assert optimizer_step_budget(5, 3, CheckpointSteps(30, 10, 3)) == 30  # past the end: nothing more runs


def test_bad_algo_values_fail_at_startup():
    with pytest.raises(ValueError, match="grad_clip must be > 0"):
        compose([*TINY, "algo.grad_clip=0"])
