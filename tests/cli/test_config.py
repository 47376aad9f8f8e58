"""The orbit-rl command's configuration: composition, validation and clear errors (real subprocesses)."""

import subprocess
import sys

import pytest

from orbit_lightning.cli import compose


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orbit_lightning.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_default_config_composes_to_the_schema():
    cfg, yaml = compose([])
    assert cfg.model.path == "orbit-tiny-moe" and cfg.model.quant == "int4"
    assert cfg.algo.advantage == "grpo" and cfg.adapter.type == "lora"
    assert "orbit_schema" not in yaml


@pytest.mark.parametrize("overrides,check", [
    (["algo=dr_grpo"], lambda c: c.algo.advantage == "dr_grpo" and c.algo.loss_agg == "seq_mean_token_sum_norm"),
    (["quant=nvfp4"], lambda c: c.model.quant == "nvfp4"),
    (["quant=none"], lambda c: c.model.quant is None),
    (["experiment=smoke"], lambda c: c.trainer.max_steps == 2 and c.name == "smoke"),
    (["trainer.max_steps=7", "rollout.group_size=4"], lambda c: c.trainer.max_steps == 7),
    (["rollout.decode_steps=4"], lambda c: c.rollout.decode_steps == 4),
])
def test_overrides(overrides, check):
    cfg, _ = compose(overrides)
    assert check(cfg)


def test_print_config_subcommand():
    out = run_cli("mode=print_config", "algo=gspo")
    assert out.returncode == 0, out.stderr
    assert "policy_loss: gspo" in out.stdout


@pytest.mark.parametrize("arg,message", [
    ("algo.bogus=1", "algo.bogus"),
    ("+algo.bogus=1", "unknown config key 'algo.bogus'"),
    ("algo=nope", "Available options in 'algo'"),
    ("trainer.max_steps=abc", "trainer.max_steps"),
    ("algo.advantage=ppo2", "algo.advantage='ppo2' is not one of"),
    ("mode=fly", "mode='fly' is not one of"),
    ("rollout.decode_steps=0", "rollout.decode_steps must be >= 1"),
    # Hydra's own text for these hides the key or value at fault in its cause, or suggests `+key=value`
    ("trainer.max_step=3", "unknown config key 'trainer.max_step'; valid keys here: ['accelerator'"),
    ("rollout.bogus.x=1", "unknown config key 'rollout.bogus'"),
    ("optim.lr=fast", "'fast' of type 'str' could not be converted to Float"),
    ("experiment=smok", "Could not find 'experiment/smok'"),
    ("rollout.temperature=-1", "rollout.temperature must be a finite number >= 0"),
    ("rollout.eval_temperature=-1", "rollout.eval_temperature must be a finite number >= 0"),
    ("rollout.top_p=0", "rollout.top_p must be in (0, 1]"),
    ("data=jsonl", "data.source has no value; set it: data.source=<value>"),  # not the default's arithmetic
    ("strategy.name=dedicated", "strategy=dedicated needs strategy.rollout_device"),
    ("model.int4_layout=sideways", "model.int4_layout='sideways': expected one of auto, row-major, tiled"),
])
def test_bad_config_fails_at_startup_with_a_clear_message(arg, message):
    out = run_cli(arg)
    assert out.returncode == 2
    assert "bad configuration" in out.stderr and message in out.stderr, out.stderr


def runtime_error(tmp_path, *args: str) -> str:
    """A run that fails after the configuration is read: exit 1, the console ending on one line that names what was
    wrong, the traceback kept in <output_dir>/error.log. -> that line."""
    out = run_cli("experiment=smoke", f"trainer.output_dir={tmp_path}", *args)
    assert out.returncode == 1, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-2]
    assert out.stderr.strip().endswith(f"(traceback in {tmp_path / 'error.log'}; ORBIT_TRACEBACK=1 prints it here)")
    assert "Traceback" not in out.stderr and "Traceback" in (tmp_path / "error.log").read_text()
    return last


def test_missing_checkpoint_for_resume(tmp_path):
    assert "no such checkpoint file" in runtime_error(tmp_path, f"trainer.resume={tmp_path}/nope.ckpt")


@pytest.mark.parametrize("arg,message", [
    ("reward.functions=[{name: nope, weight: 1.0}]", "unknown reward 'nope'; registered: arithmetic_exact"),
    ("reward.functions=[{name: 'no_such_module:score', weight: 1.0}]", "cannot import 'no_such_module'"),
    ("model.path=/nonexistent/model", "/nonexistent/model"),
])
def test_runtime_errors_name_what_was_wrong(tmp_path, arg, message):
    assert message in runtime_error(tmp_path, arg)


def test_a_corrupt_checkpoint_to_resume_is_named(tmp_path):
    (tmp_path / "bad.ckpt").write_bytes(b"PK" + bytes(4000))
    line = runtime_error(tmp_path, f"trainer.resume={tmp_path}/bad.ckpt")
    assert f"checkpoint {tmp_path}/bad.ckpt cannot be read: it is truncated, corrupt" in line
    assert "trainer.resume=null" in line


def test_missing_prompt_file_names_the_key(tmp_path):
    line = runtime_error(tmp_path, "data=jsonl", "data.source=no/such/prompts.jsonl")
    assert "data.source: prompt source 'no/such/prompts.jsonl' does not exist" in line


def test_a_reward_by_import_path_trains(tmp_path):
    (tmp_path / "my_rewards.py").write_text("def odd_length(prompt, completion, metadata):\n"
                                            "    return float(len(completion) % 2)\n")
    out = subprocess.run([sys.executable, "-m", "orbit_lightning.cli", "experiment=smoke", "trainer.max_steps=1",
                          "trainer.output_dir=run", "reward.functions=[{name: 'my_rewards:odd_length', weight: 1.0}]"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "reward/my_rewards:odd_length" in (tmp_path / "run" / "metrics.csv").read_text().splitlines()[0]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_cuda_device_without_a_gpu_is_named(tmp_path):
    assert "model.device='cuda' but torch sees no CUDA GPU" in runtime_error(tmp_path, "model.device=cuda")


def test_resuming_with_another_adapter_config_is_named(tmp_path):
    out = run_cli("experiment=smoke", "trainer.max_steps=1", "trainer.checkpoint_every=1",
                  f"trainer.output_dir={tmp_path}")
    assert out.returncode == 0, out.stderr[-3000:]
    line = runtime_error(tmp_path, "adapter.r=3", "trainer.resume=auto")
    assert "the checkpoint's adapter does not fit this run's" in line and "adapter.* settings" in line
