"""Regressions found in review: dedicated engine placement, eval with rejected prompts, optimizer-step cadence."""

import logging

import lightning as L
import peft
import pytest
import torch

from orbit_lightning import add_adapter, load_model
from orbit_lightning.cli import compose
from orbit_lightning.data.tokenizer import CharTokenizer
from orbit_lightning.module import RLModule
from orbit_lightning.rewards import RewardRunner
from orbit_lightning.rl.config import RolloutConfig
from orbit_lightning.strategies import DedicatedRolloutStrategy
from orbit_lightning.train import run_train
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


def test_checkpoints_count_rl_steps_after_a_resume_off_a_boundary(tmp_path, caplog):
    """6 optimizer steps at 4 per RL step (minibatches changed since; a mid-step crash.ckpt looks alike): the resume
    says so, and periodic checkpoints still come every RL step (Lightning's ModelCheckpoint, which counted optimizer
    steps, wrote none after such a resume: 10 and 14 are not multiples of 4)."""
    args = [*SHIPPED, "data.prompts_per_step=2", "rollout.group_size=2", "trainer.checkpoint_every=1",
            f"trainer.output_dir={tmp_path}"]
    run_train(compose([*args, "algo.minibatches=3", "trainer.max_steps=2"])[0])
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.ckpt", "rl_step=2.ckpt"]
    caplog.set_level(logging.WARNING)
    run_train(compose([*args, "algo.minibatches=4", "trainer.max_steps=3", "trainer.resume=auto"])[0])
    assert "is not at an RL-step boundary (6 optimizer steps, 4 per RL step)" in caplog.text
    # (max_steps counts 3 x 4 optimizer steps: from 6, RL steps 3 and 4 run, ending at 14)
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.ckpt", "rl_step=4.ckpt"]  # the earlier ones: gone
    assert (ckpts / "last.ckpt").samefile(ckpts / "rl_step=4.ckpt")  # one file, two names
    last = torch.load(ckpts / "last.ckpt", weights_only=False)
    assert last["global_step"] == 14 and last["orbit"]["rl_step"] == 4


def test_bad_algo_values_fail_at_startup():
    with pytest.raises(ValueError, match="grad_clip must be > 0"):
        compose([*TINY, "algo.grad_clip=0"])
