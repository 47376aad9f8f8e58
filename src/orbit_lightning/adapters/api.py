"""`add_adapter(model, peft_config)`: wrap targeted modules with adapter layers (LoRA or OFT)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from .slots import TRAIN_SLOT, AdapterState, allocate_slots
from .targets import expert_projections, find_targets, is_experts

# peft_type -> builder(module name, module, state, config) -> adapter layer. OFT registers itself from oft.py.
ADAPTER_BUILDERS: dict[str, Callable[[str, nn.Module, AdapterState, object], nn.Module]] = {}


def register_adapter(peft_type: str):
    def deco(fn):
        ADAPTER_BUILDERS[peft_type] = fn
        return fn

    return deco


@register_adapter("LORA")
def _build_lora(name: str, module: nn.Module, state: AdapterState, cfg) -> nn.Module:
    from .lora import LoraExperts, LoraLinear

    if cfg.r <= 0:
        raise ValueError(f"LoRA rank r must be > 0, got {cfg.r}")
    if is_experts(module):
        return LoraExperts(module, state, cfg.r, cfg.lora_alpha, cfg.use_rslora,
                           projections=expert_projections(name, cfg.target_modules))
    return LoraLinear(module, state, cfg.r, cfg.lora_alpha, cfg.use_rslora, cfg.lora_dropout)


def _peft_type(cfg) -> str:
    t = getattr(cfg, "peft_type", None)
    return getattr(t, "value", t) or type(cfg).__name__.removesuffix("Config").upper()


def add_adapter(model: nn.Module, peft_config, slots: tuple[str, ...] = ()) -> nn.Module:
    """Add a trainable adapter (the "train" slot) plus frozen engine `slots`; the base stays frozen.

    `peft_config` is a `peft.LoraConfig` or `peft.OFTConfig`. Returns the model (modified in place).
    """
    if getattr(model, "_orbit_adapter_state", None) is not None:
        raise ValueError("this model already has an adapter; load weights with load_adapter instead")
    kind = _peft_type(peft_config)
    if kind == "OFT":
        from . import oft  # noqa: F401  (registers the OFT builder on import)
    if kind not in ADAPTER_BUILDERS:
        raise ValueError(f"adapter type {kind!r} is not supported (supported: {sorted(ADAPTER_BUILDERS)})")
    if getattr(peft_config, "target_parameters", None):
        raise ValueError("target_parameters is not supported; target routed experts with target_modules=['experts']")
    targets = find_targets(model, peft_config.target_modules, getattr(peft_config, "exclude_modules", None))
    model.requires_grad_(False)
    state = AdapterState()
    for name, module in targets:
        layer = ADAPTER_BUILDERS[kind](name, module, state, peft_config)
        layer.train(module.training)  # an eval-mode model stays in eval mode (no adapter dropout in rollouts)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
    model._orbit_adapter_state = state
    model._orbit_peft_config = peft_config
    allocate_slots(model, list(slots))
    state.active = TRAIN_SLOT
    return model


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]
