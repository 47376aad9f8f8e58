"""torchao's `quantize_` with our configs: the same modules and bit-identical logits as `quantize_model`."""

import copy
import subprocess
import sys

import pytest
import torch
from torch import nn

pytest.importorskip("torchao")  # a core dependency; absent only on the bare GPU image
from torchao.quantization import FqnToConfig, quantize_  # noqa: E402

from orbit_lightning import load_model  # noqa: E402
from orbit_lightning.models.moe import Experts  # noqa: E402
from orbit_lightning.quant.apply import quantize_model  # noqa: E402
from orbit_lightning.quant.experts import QuantExperts  # noqa: E402
from orbit_lightning.quant.linear import QuantLinear  # noqa: E402
from orbit_lightning.quant.torchao_api import (  # noqa: E402
    Fp8BlockConfig,
    Int4GroupConfig,
    MXFP4Config,
    NF4Config,
    NVFP4Config,
    linear_or_experts,
)

IDS = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(0))


def _pair(preset):
    model = load_model(preset, dtype=torch.float32)
    return model, copy.deepcopy(model)


def _logits(model):
    with torch.no_grad():
        return model(IDS)


def test_default_filter_packs_every_linear_including_lm_head():
    model, ref = _pair("tiny-qwen3")
    quantize_(model, Int4GroupConfig())
    quantize_model(ref, "int4", skip=())  # same set: lm_head too
    assert isinstance(model.lm_head, QuantLinear) and model.lm_head.fmt.name == "int4"
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert torch.equal(_logits(model), _logits(ref))


def test_tiled_int4_stores_what_it_can_tile_and_computes_as_int4():
    """Int4GroupConfig(tiled=True): a layer whose shape makes whole blocks is int4-tiled, one that does not stays
    row-major int4, and the model's outputs are int4's bits (the same values, laid out apart)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 40))  # (the second: K = 64, N = 40)
    ref = copy.deepcopy(model)
    quantize_(model, Int4GroupConfig(tiled=True))
    quantize_(ref, Int4GroupConfig())
    assert [model[0].fmt.name, model[2].fmt.name] == ["int4-tiled", "int4"]
    assert not torch.equal(model[0].weight_packed, ref[0].weight_packed)
    x = torch.randn(3, 256)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))


def test_default_filter_leaves_routed_experts_alone():
    model = load_model("tiny-qwen3-moe", dtype=torch.float32)
    quantize_(model, Int4GroupConfig())
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert experts and all(type(m) is Experts for m in experts)


@pytest.mark.parametrize("preset,config,name", [
    ("tiny-qwen3-moe", Int4GroupConfig(), "int4"),
    ("tiny-qwen3-moe", Fp8BlockConfig(), "fp8"),
    ("tiny-qwen3-moe", MXFP4Config(), "mxfp4"),
    ("tiny-qwen3-moe", NVFP4Config(), "nvfp4"),
    ("tiny-deepseek-v3", Int4GroupConfig(), "int4"),
    # K = 32 in the tiny MoE's expert down_proj: group 64 / nf4 blocks of 64 need the dense model.
    ("tiny-qwen3", Int4GroupConfig(group_size=64), "int4-g64"),
    ("tiny-qwen3", NF4Config(), "nf4"),
])
def test_linear_and_expert_filter_equals_quantize_model(preset, config, name):
    model, ref = _pair(preset)
    quantize_(model, config, filter_fn=linear_or_experts)
    quantize_model(ref, name)  # default skip: lm_head stays float
    assert type(model.lm_head) is nn.Linear
    packed = [m for m in model.modules() if isinstance(m, (QuantLinear, QuantExperts))]
    assert packed and all(m.fmt.name == name for m in packed)
    assert any(isinstance(m, QuantExperts) for m in packed) == (preset != "tiny-qwen3")
    assert not any(type(m) in (nn.Linear, Experts) for n, m in model.named_modules() if n != "lm_head")
    assert torch.equal(_logits(model), _logits(ref))


def test_fqn_to_config_mixes_formats_per_module():
    model, ref = _pair("tiny-deepseek-v3")
    # Broad regexes: `self_attn\..*` also matches the q_a/kv_a norms (via their weights), `.*experts` also the
    # shared_experts MLP container; both are left as they are.
    cfg = FqnToConfig({r"re:.*experts": Int4GroupConfig(), r"re:.*self_attn\..*": Fp8BlockConfig()})
    quantize_(model, cfg, filter_fn=None)  # torchao 0.18 refuses FqnToConfig with a filter_fn
    for name, m in model.named_modules():
        if name.endswith("mlp.experts"):
            assert isinstance(m, QuantExperts) and m.fmt.name == "int4", name
        elif name.endswith("norm"):
            assert type(m).__name__ == "RMSNorm", name
        elif ".self_attn." in name:
            assert isinstance(m, QuantLinear) and m.fmt.name == "fp8", name
        elif isinstance(m, (QuantLinear, QuantExperts)):
            raise AssertionError(f"{name} should have stayed float")
    # The same choices through our own entry point, one format at a time.
    quantize_model(ref, "int4", skip=[r"^(?!.*\.experts$)"])
    quantize_model(ref, "fp8", skip=[r"^(?!.*self_attn\.)"])
    assert torch.equal(_logits(model), _logits(ref))


def test_fqn_to_config_exact_parameter_and_module_names():
    model = load_model("tiny-qwen3-moe", dtype=torch.float32)
    cfg = FqnToConfig({"model.layers.0.self_attn.q_proj.weight": NVFP4Config(),
                       "model.layers.1.mlp.experts": MXFP4Config()})
    quantize_(model, cfg, filter_fn=None)
    packed = {n: m.fmt.name for n, m in model.named_modules() if isinstance(m, (QuantLinear, QuantExperts))}
    assert packed == {"model.layers.0.self_attn.q_proj": "nvfp4", "model.layers.1.mlp.experts": "mxfp4"}


def test_packed_modules_and_bad_configs():
    with pytest.raises(ValueError, match="group_size must be one of"):
        Int4GroupConfig(group_size=48)
    model = load_model("tiny-qwen3-moe", dtype=torch.float32)
    quantize_(model, Int4GroupConfig(), filter_fn=linear_or_experts)
    before = _logits(model)
    quantize_(model, Int4GroupConfig(), filter_fn=linear_or_experts)  # already int4: nothing to do
    assert torch.equal(_logits(model), before)
    with pytest.raises(ValueError, match="already packed as 'int4'; cannot re-pack it as 'nvfp4'"):
        quantize_(model, NVFP4Config(), filter_fn=lambda m, fqn: isinstance(m, Experts))


def test_core_load_path_does_not_import_torchao():
    code = ("import sys, orbit_lightning as ol; ol.load_model('tiny-qwen3', quant='int4'); "
            "assert 'torchao' not in sys.modules and 'orbit_lightning.quant.torchao_api' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
