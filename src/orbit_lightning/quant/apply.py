"""Swap a model's frozen linears and routed experts for packed ones.

The same handlers back torchao's `quantize_` (see `torchao_api.py`); this module calls them directly so that
loading a model does not need to import torchao. lm_head, embeddings, norms and routers stay in their own dtype
by default (as deployed INT4/FP4 checkpoints do); `skip` changes that.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from torch import nn

from ..models.moe import Experts

DEFAULT_SKIP = (r"(^|\.)lm_head$",)


def quantize_linear(module: nn.Linear, fmt) -> nn.Module:
    from .linear import QuantLinear

    return QuantLinear.from_linear(module, fmt)


def quantize_experts(module: Experts, fmt) -> nn.Module:
    from .experts import QuantExperts

    return QuantExperts.from_experts(module, fmt)


def quantize_model(model: nn.Module, fmt: str, skip: Iterable[str] = DEFAULT_SKIP) -> nn.Module:
    """In place: every nn.Linear and Experts whose name matches no `skip` regex becomes packed in `fmt`."""
    from .formats import get_format

    fmt_obj = get_format(fmt) if isinstance(fmt, str) else fmt
    patterns = [re.compile(p) for p in skip]
    for name, module in list(model.named_modules()):
        if any(p.search(name) for p in patterns):
            continue
        if type(module) is nn.Linear:
            new = quantize_linear(module, fmt_obj)
        elif type(module) is Experts:
            new = quantize_experts(module, fmt_obj)
        else:
            continue
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    return model


def checkpoint_format(hf_config: dict):
    """The packed format a checkpoint's config.json declares (compressed-tensors int4, DeepSeek fp8), or None."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    from .formats import fp8_from_quantization_config, int4_from_quantization_config

    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return int4_from_quantization_config(qc)
    if method == "fp8":
        return fp8_from_quantization_config(qc)
    raise ValueError(f"unsupported quantization_config.quant_method {method!r} in config.json "
                     "(supported: compressed-tensors pack-quantized int4, fp8 block)")


def checkpoint_skip(hf_config: dict) -> tuple[str, ...]:
    """Regexes of the modules a pre-quantized checkpoint keeps unpacked (compressed-tensors `ignore`, or
    `modules_to_not_convert`): a "re:" entry is a regex over the whole module name, a plain one a module path."""
    qc = hf_config.get("quantization_config") or {}
    out = []
    for entry in list(qc.get("ignore") or []) + list(qc.get("modules_to_not_convert") or []):
        out.append(f"^(?:{entry[3:]})$" if entry.startswith("re:") else rf"(^|\.){re.escape(entry)}$")
    return tuple(out)
