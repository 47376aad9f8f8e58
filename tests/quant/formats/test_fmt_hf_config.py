"""Parsing HF config.json quantization_config dicts into formats."""

import copy

import pytest

from orbit_lightning.quant.formats import (
    Fp8BlockFormat,
    Int4Format,
    format_from_quantization_config,
    fp8_from_quantization_config,
    int4_from_quantization_config,
)

# Shaped like Kimi-K2's compressed-tensors config (trimmed ignore list).
KIMI_INT4 = {
    "config_groups": {
        "group_0": {
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None,
                "block_structure": None,
                "dynamic": False,
                "group_size": 32,
                "num_bits": 4,
                "observer": "minmax",
                "strategy": "group",
                "symmetric": True,
                "type": "int",
            },
        }
    },
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*"],
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}

DEEPSEEK_FP8 = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}


def _with(base: dict, path: tuple, value) -> dict:
    qc = copy.deepcopy(base)
    node = qc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return qc


def test_int4_config():
    assert int4_from_quantization_config(KIMI_INT4) == Int4Format(32)
    qc = _with(KIMI_INT4, ("config_groups", "group_0", "weights", "group_size"), 128)
    assert format_from_quantization_config(qc) == Int4Format(128)


W = ("config_groups", "group_0", "weights")


@pytest.mark.parametrize(
    "path, value, message",
    [
        (("format",), "naive-quantized", "format must be 'pack-quantized'"),
        ((*W, "num_bits"), 8, "num_bits must be 4"),
        ((*W, "symmetric"), False, "only symmetric"),
        ((*W, "strategy"), "channel", "strategy must be 'group'"),
        ((*W, "group_size"), 16, "group_size must be one of"),
        ((*W, "actorder"), "group", "g_idx"),
        (("config_groups", "group_0", "input_activations"), {"num_bits": 8}, "activation quantization"),
    ],
)
def test_int4_config_rejections(path, value, message):
    with pytest.raises(ValueError, match=message):
        int4_from_quantization_config(_with(KIMI_INT4, path, value))


def test_fp8_config():
    assert fp8_from_quantization_config(DEEPSEEK_FP8) == Fp8BlockFormat((128, 128))
    assert format_from_quantization_config({**DEEPSEEK_FP8, "scale_fmt": "ue8m0"}).name == "fp8"
    with pytest.raises(ValueError, match="weight_block_size"):
        fp8_from_quantization_config({k: v for k, v in DEEPSEEK_FP8.items() if k != "weight_block_size"})
    with pytest.raises(ValueError, match="fmt must be 'e4m3'"):
        fp8_from_quantization_config({**DEEPSEEK_FP8, "fmt": "e5m2"})


def test_unknown_quant_method():
    with pytest.raises(ValueError, match="unsupported quant_method 'awq'"):
        format_from_quantization_config({"quant_method": "awq"})
