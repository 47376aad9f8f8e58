"""Adapters on disk in PEFT format: `adapter_config.json` + `adapter_model.safetensors` with PEFT key names.

Key mapping (no adapter name in saved keys, as PEFT writes them):
  ours `model.layers.0.self_attn.q_proj.lora_A`
  PEFT `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`
  (every adapter tensor is a PEFT submodule's `.weight`: `lora_A`, `lora_B`, OFT's `oft_R`)
Routed-expert LoRA (A [E, r, K], B [E, N, r] per projection) is written one expert at a time under the
transformers-v4 names `...mlp.experts.{e}.{gate,up,down}_proj.lora_{A,B}.weight`: the layout PEFT 0.21 converts
on load into transformers-v5 fused experts (`target_parameters`), and the per-expert factors vLLM's MoE LoRA reads.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from ..atomic_write import atomic_write
from .slots import TRAIN_SLOT, adapter_layers, adapter_state, adapter_state_dict

PREFIX = "base_model.model."
CONFIG_NAME, WEIGHTS_NAME = "adapter_config.json", "adapter_model.safetensors"
_EXPERT_PARAM = re.compile(r"^(gate_proj|up_proj|down_proj)_(lora_[AB])$")
_PEFT_EXPERT_KEY = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(lora_[AB])\.weight$")


def to_peft_tensors(model: nn.Module, slot: str = TRAIN_SLOT) -> dict[str, Tensor]:
    """Our adapter tensors under PEFT's saved key names (see the module docstring)."""
    out = {}
    for path, layer in adapter_layers(model):
        for name, t in layer.slot_tensors(slot).items():
            t = t.detach()
            m = _EXPERT_PARAM.match(name)
            if m:  # [E, ...] -> one PEFT key per expert, as transformers-v4 MoE layouts name them
                for e in range(t.shape[0]):
                    out[f"{PREFIX}{path}.{e}.{m.group(1)}.{m.group(2)}.weight"] = t[e]
            else:  # every adapter tensor is a PEFT submodule's `.weight` (lora_A/lora_B, OFT's oft_R)
                out[f"{PREFIX}{path}.{name}.weight"] = t
    return out


def from_peft_tensors(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Inverse of `to_peft_tensors`: keys `{layer path}.{param}`, per-expert factors stacked back to [E, ...]."""
    out, experts = {}, defaultdict(dict)
    for key, t in tensors.items():
        if not key.startswith(PREFIX):
            raise ValueError(f"{key!r} is not a PEFT adapter key (expected prefix {PREFIX!r})")
        key = key[len(PREFIX):]
        m = _PEFT_EXPERT_KEY.match(key)
        if m:
            experts[f"{m.group(1)}.{m.group(3)}_{m.group(4)}"][int(m.group(2))] = t
        elif key.endswith(".weight"):
            out[key[: -len(".weight")]] = t
        else:
            out[key] = t
    for key, per_expert in experts.items():
        if sorted(per_expert) != list(range(len(per_expert))):
            raise ValueError(f"adapter tensors for {key} skip experts: have {sorted(per_expert)[:8]}...")
        out[key] = torch.stack([per_expert[e] for e in range(len(per_expert))])
    return out


def save_adapter(model: nn.Module, directory: str | Path, slot: str = TRAIN_SLOT,
                 base_model_name_or_path: str | None = None) -> Path:
    """Atomically write the adapter of `slot` in PEFT format; loads with `peft.PeftModel.from_pretrained`."""
    state = adapter_state(model)
    cfg = model._orbit_peft_config
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous().cpu() for k, v in to_peft_tensors(model, slot).items()}
    config = cfg.to_dict()
    config["base_model_name_or_path"] = base_model_name_or_path or config.get("base_model_name_or_path")
    config["task_type"] = config.get("task_type") or "CAUSAL_LM"
    for k, v in list(config.items()):
        if isinstance(v, set):
            config[k] = sorted(v)
    atomic_write(directory / WEIGHTS_NAME, lambda p: save_file(tensors, p, metadata={
        "format": "pt", "orbit_adapter_version": str(state.versions.get(slot))}))
    atomic_write(directory / CONFIG_NAME, lambda p: Path(p).write_text(json.dumps(config, indent=2, default=str)))
    return directory


def _norm(v):
    return getattr(v, "value", v)  # enums (peft_type) compare by value


def read_adapter(directory: str | Path) -> tuple[dict, dict[str, Tensor]]:
    directory = Path(directory)
    cfg_file, weights = directory / CONFIG_NAME, directory / WEIGHTS_NAME
    if not cfg_file.is_file() or not weights.is_file():
        raise FileNotFoundError(f"{directory} is not a PEFT adapter directory "
                                f"(needs {CONFIG_NAME} and {WEIGHTS_NAME})")
    try:
        tensors = load_file(weights)
    except SafetensorError as e:
        raise ValueError(f"cannot read {weights}: {e} (corrupt or truncated?)") from e
    return json.loads(cfg_file.read_text()), from_peft_tensors(tensors)


def peft_config_from_dir(directory: str | Path, cfg_dict: dict):
    import peft

    kind = cfg_dict.get("peft_type", "LORA")
    cls = {"LORA": peft.LoraConfig, "OFT": peft.OFTConfig}.get(kind)
    if cls is None:
        raise ValueError(f"adapter type {kind!r} in {CONFIG_NAME} is not supported (LORA, OFT)")
    return cls.from_pretrained(str(directory))


@torch.no_grad()
def load_adapter(model: nn.Module, directory: str | Path, slot: str = TRAIN_SLOT) -> nn.Module:
    """Load a PEFT-format adapter into `slot`; adds the adapter first when the model has none."""
    from .api import add_adapter

    cfg_dict, tensors = read_adapter(directory)
    if getattr(model, "_orbit_adapter_state", None) is None:
        add_adapter(model, peft_config_from_dir(directory, cfg_dict))
    else:  # same shapes but another scaling would load silently and change every output
        have = model._orbit_peft_config.to_dict()
        for key in ("peft_type", "r", "lora_alpha", "use_rslora", "oft_block_size", "block_share", "coft"):
            if key in cfg_dict and key in have and _norm(cfg_dict[key]) != _norm(have[key]):
                raise ValueError(f"adapter at {directory} has {key}={cfg_dict[key]!r} but this model's adapter has "
                                 f"{have[key]!r}; load it into a model without an adapter (it is added as saved)")
    targets = adapter_state_dict(model, slot)
    missing, extra = targets.keys() - tensors.keys(), tensors.keys() - targets.keys()
    if extra or missing:
        raise ValueError(
            f"adapter at {directory} does not fit this model: {len(extra)} tensors name modules the model's adapter "
            f"lacks (e.g. {sorted(extra)[:3]}), {len(missing)} adapter tensors are absent "
            f"(e.g. {sorted(missing)[:3]}); "
            "was it trained on another model or with other target_modules?")
    for k, t in targets.items():
        if t.shape != tensors[k].shape:
            raise ValueError(f"adapter at {directory}: {k} has shape {tuple(tensors[k].shape)} but this model's "
                             f"adapter needs {tuple(t.shape)} (different model size or rank?)")
    for k, t in targets.items():
        t.copy_(tensors[k])
    return model
