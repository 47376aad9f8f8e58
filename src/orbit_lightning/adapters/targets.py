"""Which modules an adapter config targets, with PEFT's matching rules, over our linears and routed experts."""

from __future__ import annotations

import re

from torch import nn

from ..models.moe import Experts


def is_linear(module: nn.Module) -> bool:
    from ..quant.linear import QuantLinear

    return type(module) is nn.Linear or isinstance(module, QuantLinear)


def is_experts(module: nn.Module) -> bool:
    return isinstance(module, Experts)


def matches(name: str, target: str | list[str] | set[str]) -> bool:
    """PEFT semantics: a string is a regex that must match the whole name; a list matches name suffixes."""
    if isinstance(target, str):
        return re.fullmatch(target, name) is not None
    return any(name == t or name.endswith("." + t) for t in target)


def expert_projections(name: str, target) -> tuple[str, ...]:
    """Routed experts follow PEFT's transformers-v4 semantics, where each expert was its own `experts.{e}.gate_proj`
    Linear: naming `gate_proj` targets the routed experts' gate too. `experts` targets all three projections."""
    if matches(name, target) or (not isinstance(target, str) and "experts" in target):
        return Experts.PROJECTIONS
    return tuple(p for p in Experts.PROJECTIONS if matches(f"{name}.0.{p}", target))


def find_targets(model: nn.Module, target_modules, exclude_modules=None) -> list[tuple[str, nn.Module]]:
    if target_modules is None:
        raise ValueError("the adapter config has no target_modules; name modules (e.g. ['q_proj', 'v_proj']), "
                         "'all-linear', or 'experts' for routed experts")
    all_linear = target_modules == "all-linear" or (
        isinstance(target_modules, (list, set, tuple)) and "all-linear" in target_modules)
    if all_linear:
        chosen = [(n, m) for n, m in model.named_modules() if is_linear(m) and not n.endswith("lm_head")]
    else:
        tm = target_modules if isinstance(target_modules, str) else set(target_modules)
        chosen = [(n, m) for n, m in model.named_modules()
                  if is_linear(m) and matches(n, tm) or is_experts(m) and expert_projections(n, tm)]
    if exclude_modules:
        chosen = [(n, m) for n, m in chosen if not matches(n, exclude_modules)]
    if not chosen:
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if is_linear(m) or is_experts(m)})
        raise ValueError(f"target_modules={target_modules!r} matches no module of this model; "
                         f"targetable names: {names}")
    return chosen
