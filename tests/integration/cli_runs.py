"""Run `orbit-rl` as a real subprocess (the user's entry point) and read what it wrote."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file

from orbit_lightning.cli import STARTUP_NOISE, STARTUP_WARNING

# A tiny, fast, deterministic configuration: random-weight tiny MoE preset, INT4 base, LoRA incl. experts.
TINY = [
    "model.path=tiny-qwen3-moe", "+model.overrides.vocab_size=47", "+model.overrides.eos_token_id=2", "quant=int4",
    "adapter.r=4",
    "adapter.target_modules=[q_proj,o_proj,gate_proj,up_proj,down_proj]",
    "data.prompts_per_step=4", "data.train_size=200", "data.eval_size=8", "rollout.group_size=4",
    "rollout.max_new_tokens=4", "rollout.eval_k=2", "trainer.eval_every=100", "trainer.eval_max_items=4",
    "trainer.threads=1", "trainer.report=false", "optim.lr=1e-2",
]


# The shipped pretrained tiny MoE (its rewards vary within a group, so every step moves the adapter).
SHIPPED = [
    "adapter.r=4", "data.prompts_per_step=4", "data.eval_size=8", "rollout.group_size=4", "rollout.max_new_tokens=6",
    "rollout.eval_k=2", "trainer.eval_every=100", "trainer.eval_max_items=4", "trainer.threads=1",
    "trainer.report=false", "optim.lr=1e-2", "optim.schedule=constant",
]


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "orbit_lightning.cli", *args]


def run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    out = subprocess.run(command(*args), capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-4000:]
    noise = [needle for needle in (*STARTUP_NOISE.values(), STARTUP_WARNING) if needle in out.stderr]
    assert not noise, f"dependency startup noise the command drops (cli.STARTUP_*): {noise}\n{out.stderr[:3000]}"
    assert "`weights_only` was not set" not in out.stderr  # Lightning's line for each checkpoint saved without it
    return out


def adapter(run_dir: Path) -> dict:
    return load_file(run_dir / "adapter" / "adapter_model.safetensors")
