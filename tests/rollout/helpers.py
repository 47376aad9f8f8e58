"""Shared builders for the rollout tests: tiny int4 models with a random LoRA, and the trainer-side oracle."""

from __future__ import annotations

import peft
import torch

from orbit_lightning import add_adapter, load_model
from orbit_lightning.adapters import adapter_state_dict, copy_into_slot
from orbit_lightning.models import token_logprobs

# Routed experts are targeted too (gate/up/down name them on MoE models), so every MoE path carries LoRA.
TARGETS = {
    "tiny-qwen3": "all-linear",
    "tiny-qwen3-moe": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "tiny-deepseek-v3": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj",
                         "up_proj", "down_proj"],
}
LOGPROB_TOL = 1e-5  # fp32, same modules and packed weights; only the attention's key order/length differs


def randomize_adapter(model, seed: int = 0, scale: float = 0.05) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(scale * torch.randn(p.shape, generator=g))


def random_adapter_state(model, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """A new adapter version: same keys and shapes as the model's adapter, fresh random values."""
    g = torch.Generator().manual_seed(seed)
    return {k: scale * torch.randn(v.shape, generator=g) for k, v in adapter_state_dict(model).items()}


def lora_model(preset: str = "tiny-qwen3", seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu",
               **overrides):
    model = load_model(preset, dtype=dtype, quant="int4", device=device, **overrides)
    add_adapter(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS[preset]))
    randomize_adapter(model, seed)
    return model


def prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def teacher_forced(model, prompt: list[int], completion: list[int], adapter: dict | None = None) -> torch.Tensor:
    """The trainer's log-probs of `completion` after `prompt` ([len(completion)] fp32), with the adapter on.
    `adapter` (a state dict) is loaded into the trainer's slot first, to score under a given version."""
    if adapter is not None:
        copy_into_slot(model, "train", adapter)
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        lp, _ = token_logprobs(model, ids, start=len(prompt) - 1)
    return lp[0]


def max_logprob_diff(model, prompt: list[int], completion, adapter: dict | None = None) -> float:
    ref = teacher_forced(model, prompt, completion.token_ids, adapter)
    return (ref - torch.tensor(completion.logprobs)).abs().max().item()
