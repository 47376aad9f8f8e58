"""Bad input during a real run: failing or NaN rewards are masked, bad data fails clearly, nothing is lost."""

import csv
import json
import logging
import math
import os
import signal

import pytest
from orbit_lightning.callbacks import RunInterrupted

from orbit_lightning.cli import compose
from orbit_lightning.rewards import register_reward
from orbit_lightning.train import run_train
from tests.integration.cli_runs import TINY


@register_reward("test_raises_on_odd_length", overwrite=True)
def _raises_on_odd(prompt, completion, metadata):
    if len(completion) % 2:
        raise RuntimeError("verifier crashed")
    return 1.0


@register_reward("test_nan_on_even_length", overwrite=True)
def _nan_on_even(prompt, completion, metadata):
    return math.nan if len(completion) % 2 == 0 else 0.5


@register_reward("test_always_raises", overwrite=True)
def _always_raises(prompt, completion, metadata):
    raise ConnectionError("reward server unreachable")


_SIGNALLED = []


@register_reward("test_sigterm_once", overwrite=True)
def _sigterm_once(prompt, completion, metadata):
    """SIGTERM to this process at its first call: during the evaluation before the first step."""
    if not _SIGNALLED:
        _SIGNALLED.append(True)
        os.kill(os.getpid(), signal.SIGTERM)
    return 1.0


def _metrics(run_dir):
    with open(run_dir / "metrics.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("reward", ["test_raises_on_odd_length", "test_nan_on_even_length"])
def test_failing_rewards_are_masked_and_the_run_goes_on(reward, tmp_path):
    cfg, _ = compose([*TINY, "trainer.max_steps=2", f"trainer.output_dir={tmp_path}",
                      f"reward.functions=[{{name: {reward}, weight: 1.0}}]"])
    out = run_train(cfg)
    rows = [r for r in _metrics(tmp_path) if r.get("reward/failed_fraction")]
    assert len(rows) == 2
    failed = [float(r["reward/failed_fraction"]) for r in rows]
    assert all(0 < f < 1 for f in failed), failed  # some samples failed, the rest trained
    assert all(math.isfinite(float(r["grad_norm"])) for r in rows)
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file() and out["adapter"]


def test_a_reward_that_always_fails_stops_the_run_with_a_checkpoint(tmp_path):
    cfg, _ = compose([*TINY, "trainer.max_steps=6", f"trainer.output_dir={tmp_path}",
                      "reward.functions=[{name: test_always_raises, weight: 1.0}]"])
    with pytest.raises(RuntimeError, match="failed in 3 RL steps in a row.*reward server unreachable"):
        run_train(cfg)
    assert (tmp_path / "checkpoints" / "crash.ckpt").is_file()  # the two (empty) steps before are kept
    assert not (tmp_path / "adapter").exists()


def test_empty_dataset_is_a_clear_error(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cfg, _ = compose([*TINY, f"data.source={empty}", f"trainer.output_dir={tmp_path}"])
    with pytest.raises(ValueError, match="empty"):
        run_train(cfg)


def test_prompts_longer_than_the_context_are_dropped_with_a_warning(tmp_path, caplog):
    rows = [{"prompt": "1+1=", "answer": "2"}] * 6 + [{"prompt": "1+" * 40 + "1=", "answer": "41"}] * 6
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    cfg, _ = compose([*TINY, f"data.source={data}", "data.eval_size=2", "data.max_prompt_tokens=16",
                      "trainer.max_steps=1", f"trainer.output_dir={tmp_path / 'run'}"])
    run_train(cfg)
    assert any("longer than" in r.message or "dropped" in r.message for r in caplog.records)


def test_prompts_the_context_cannot_hold_are_dropped_before_the_run(tmp_path, caplog):
    """data.max_prompt_tokens above the model's context: prompts that leave no room to generate are dropped when the
    data loads (the engine would refuse each, every step)."""
    rows = [{"prompt": "1+1=", "answer": "2"}] * 6 + [{"prompt": "1+" * 40 + "1=", "answer": "41"}] * 6
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    cfg, _ = compose([*TINY, "+model.overrides.max_position_embeddings=48", f"data.source={data}",
                      "data.max_prompt_tokens=512", "data.eval_size=2", "trainer.max_steps=1",
                      f"trainer.output_dir={tmp_path / 'run'}"])
    caplog.set_level(logging.INFO)
    run_train(cfg)
    assert "the model's context of 48 tokens holds prompts of up to 47" in caplog.text
    assert "dropped" in caplog.text and "rejected by the rollout engine" not in caplog.text


def test_sigterm_during_the_first_evaluation_stops_before_any_step(tmp_path):
    cfg, _ = compose([*TINY, "trainer.max_steps=3", f"trainer.output_dir={tmp_path}",
                      "reward.functions=[{name: test_sigterm_once, weight: 1.0}]"])
    with pytest.raises(RunInterrupted, match="stopped by SIGTERM after RL step 0; no checkpoint was written") as info:
        run_train(cfg)
    assert info.value.signum == signal.SIGTERM and _SIGNALLED
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "adapter").exists()
