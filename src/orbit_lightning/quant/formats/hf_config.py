"""Map a Hugging Face `config.json` "quantization_config" dict to the matching QuantFormat.

Only the weight format is decided here; which modules are quantized (compressed-tensors' "ignore" list,
"targets", DeepSeek's unquantized norms/gates) is the checkpoint loader's business.
"""

from __future__ import annotations

from .fp8 import Fp8BlockFormat
from .int4 import INT4_GROUP_SIZES, Int4Format
from .registry import QuantFormat


def _require(ok: bool, what: str) -> None:
    # The message names the offending field only: real configs carry ignore lists of hundreds of modules.
    if not ok:
        raise ValueError(f"unsupported quantization_config: {what}")


def int4_from_quantization_config(qc: dict) -> Int4Format:
    """compressed-tensors "pack-quantized" symmetric int4 group quantization (e.g. Kimi-K2) -> Int4Format.

    Expects `config_groups.<name>.weights` with num_bits 4, type "int", symmetric, strategy "group" and a
    supported group_size, and no activation quantization. Every config group must agree.
    """
    method = qc.get("quant_method", "compressed-tensors")
    _require(method == "compressed-tensors", f"quant_method must be 'compressed-tensors', not {method!r}")
    groups = qc.get("config_groups") or {}
    _require(len(groups) > 0, "no config_groups")
    group_sizes = set()
    for name, group in groups.items():
        fmt = group.get("format", qc.get("format"))
        _require(fmt == "pack-quantized", f"group {name!r}: format must be 'pack-quantized', not {fmt!r}")
        weights = group.get("weights") or {}
        _require(weights.get("num_bits") == 4, f"group {name!r}: weights.num_bits must be 4")
        _require(weights.get("type", "int") == "int", f"group {name!r}: weights.type must be 'int'")
        _require(weights.get("symmetric") is True, f"group {name!r}: only symmetric int4 is supported")
        _require(weights.get("strategy") == "group", f"group {name!r}: weights.strategy must be 'group'")
        actorder_ok = weights.get("actorder") in (None, False, "weight", "static")
        _require(actorder_ok, f"group {name!r}: actorder 'group' needs a g_idx permutation (unsupported)")
        weight_only = group.get("input_activations") is None and group.get("output_activations") is None
        _require(weight_only, f"group {name!r}: activation quantization is not supported")
        group_sizes.add(weights.get("group_size"))
    _require(len(group_sizes) == 1, f"config groups disagree on group_size: {sorted(map(str, group_sizes))}")
    (group_size,) = group_sizes
    _require(group_size in INT4_GROUP_SIZES, f"group_size must be one of {INT4_GROUP_SIZES}")
    return Int4Format(group_size=group_size)


def fp8_from_quantization_config(qc: dict) -> Fp8BlockFormat:
    """DeepSeek-V3 style block fp8 (`quant_method: fp8`, `fmt: e4m3`, `weight_block_size: [128, 128]`).

    `scale_fmt: ue8m0` (DeepSeek-V3.1) is accepted: the scales are then powers of two and dequantization is
    unchanged; a loader that meets them stored as float8_e8m0fnu must cast them to float32.
    """
    _require(qc.get("quant_method") == "fp8", "quant_method must be 'fp8'")
    _require(qc.get("fmt", "e4m3") == "e4m3", "fmt must be 'e4m3'")
    _require(qc.get("scale_fmt") in (None, "ue8m0"), "scale_fmt must be absent or 'ue8m0'")
    block = qc.get("weight_block_size")
    block_ok = block is not None and len(block) == 2
    _require(block_ok, f"weight_block_size must be [rows, cols] (per-tensor fp8 is unsupported), not {block}")
    return Fp8BlockFormat(block=tuple(block))


def format_from_quantization_config(qc: dict) -> QuantFormat:
    """Dispatch on `quant_method`: "compressed-tensors" -> int4, "fp8" -> block fp8."""
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return int4_from_quantization_config(qc)
    if method == "fp8":
        return fp8_from_quantization_config(qc)
    raise ValueError(
        f"unsupported quant_method {method!r} in quantization_config; supported: 'compressed-tensors' "
        "(pack-quantized int4) and 'fp8' (DeepSeek block fp8)"
    )
