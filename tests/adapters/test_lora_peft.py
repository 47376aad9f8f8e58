"""Our LoRA on our (dense or packed) base vs `peft.PeftModel` on the transformers model with the same weights."""

import peft
import pytest
import torch

from orbit_lightning import add_adapter, load_adapter, load_model, save_adapter
from tests.hf_models import make_hf_model, peft_oracle_max_diff, save_hf_model

TOL = 1e-4  # fp32 end to end


def _randomize_adapter(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))


# DeepSeek's dense first layers and shared experts also carry `gate_proj`/`up_proj`/`down_proj`; PEFT 0.21 maps
# those names to the fused routed experts only (transformers v4->v5 conversion), so MLP targets on DeepSeek are
# compared in our own tests (test_adapters_train.py), not against PEFT.
CASES = [
    ("qwen3-gqa2", None, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    ("qwen3_moe-top2", None, ["q_proj", "v_proj", "o_proj"]),
    ("deepseek_v3-qlora", None, ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]),
    ("qwen3-gqa2", "int4", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    ("qwen3_moe-top2", "int4", ["q_proj", "k_proj", "v_proj", "o_proj"]),
    ("qwen3-odd-heads-tied", "int4-g64", "all-linear"),
    ("deepseek_v3-no-qlora-yarn", "int4", ["q_proj", "kv_a_proj_with_mqa", "o_proj"]),
    ("deepseek_v3-qlora", "fp8", ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]),
    ("qwen3_moe-top2", "nvfp4", ["q_proj", "k_proj"]),
    ("qwen3-gqa2", "mxfp4", ["q_proj", "down_proj"]),
]


@pytest.mark.parametrize("name,quant,targets", CASES)
@pytest.mark.parametrize("rslora", [False, True])
def test_saved_adapter_matches_peft(name, quant, targets, rslora, tmp_path):
    src = save_hf_model(make_hf_model(name), tmp_path / "base")
    ours = load_model(src, quant=quant, dtype=torch.float32)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, use_rslora=rslora)
    add_adapter(ours, cfg)
    _randomize_adapter(ours)
    save_adapter(ours, tmp_path / "adapter")

    diff, moved, _ = peft_oracle_max_diff(ours, src, tmp_path / "adapter", tmp_path)
    assert diff <= TOL
    assert moved > 1e-3  # the adapter changes the output, so the comparison is not vacuous


EXPERT_CASES = [
    ("qwen3_moe-top2", None),
    ("qwen3_moe-top2", "int4"),
    ("qwen3_moe-top2", "fp8"),
    ("qwen3_moe-top2", "mxfp4"),
]


@pytest.mark.parametrize("name,quant", EXPERT_CASES)
def test_routed_expert_lora_loads_in_peft(name, quant, tmp_path):
    """Expert LoRA saved per expert (transformers-v4 names); PEFT 0.21 converts it to v5 fused experts on load."""
    src = save_hf_model(make_hf_model(name), tmp_path / "base")
    ours = load_model(src, quant=quant, dtype=torch.float32)
    add_adapter(ours, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj", "gate_proj",
                                                                         "up_proj", "down_proj"]))
    assert any(type(m).__name__ == "LoraExperts" for m in ours.modules())
    _randomize_adapter(ours, seed=5)
    save_adapter(ours, tmp_path / "adapter")
    diff, moved, _ = peft_oracle_max_diff(ours, src, tmp_path / "adapter", tmp_path)
    assert diff <= TOL and moved > 1e-3


def test_disable_adapter_equals_adapter_free_model_exactly(tmp_path):
    src = save_hf_model(make_hf_model("qwen3_moe-top2"), tmp_path / "base")
    plain = load_model(src, quant="int4", dtype=torch.float32)
    with_adapter = load_model(src, quant="int4", dtype=torch.float32)
    add_adapter(with_adapter, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    _randomize_adapter(with_adapter)
    ids = torch.randint(0, 97, (2, 8))
    with torch.no_grad(), with_adapter.disable_adapter():
        assert torch.equal(with_adapter(ids), plain(ids))


def test_load_adapter_roundtrip_into_fresh_model(tmp_path):
    src = save_hf_model(make_hf_model("qwen3-gqa2"), tmp_path / "base")
    a = load_model(src, quant="int4", dtype=torch.float32)
    add_adapter(a, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "down_proj"]))
    _randomize_adapter(a, seed=3)
    save_adapter(a, tmp_path / "ad")
    b = load_adapter(load_model(src, quant="int4", dtype=torch.float32), tmp_path / "ad")
    ids = torch.randint(0, 97, (2, 6))
    with torch.no_grad():
        assert torch.equal(a(ids), b(ids))


def test_adapter_for_another_model_is_rejected(tmp_path):
    a = load_model(save_hf_model(make_hf_model("qwen3-gqa2"), tmp_path / "a"), dtype=torch.float32)
    add_adapter(a, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    save_adapter(a, tmp_path / "ad")
    other = load_model(save_hf_model(make_hf_model("qwen3-gqa2", hidden_size=32), tmp_path / "b"),
                       dtype=torch.float32)
    with pytest.raises(ValueError, match="shape .* but this model's adapter needs"):
        load_adapter(other, tmp_path / "ad")
    moe = load_model(save_hf_model(make_hf_model("deepseek_v3-qlora"), tmp_path / "c"), dtype=torch.float32)
    with pytest.raises(ValueError, match="matches no module of this model"):
        load_adapter(moe, tmp_path / "ad")


def test_bad_adapter_configs(tmp_path):
    m = load_model("tiny-qwen3")
    with pytest.raises(ValueError, match="matches no module.*targetable names"):
        add_adapter(m, peft.LoraConfig(r=2, target_modules=["qkv"]))
    with pytest.raises(ValueError, match="rank"):
        add_adapter(load_model("tiny-qwen3"), peft.LoraConfig(r=0, target_modules=["q_proj"]))
    with pytest.raises(FileNotFoundError, match="not a PEFT adapter directory"):
        load_adapter(load_model("tiny-qwen3"), tmp_path)


def test_loading_an_adapter_with_another_scaling_is_rejected(tmp_path):
    a = load_model("tiny-qwen3")
    add_adapter(a, peft.LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj"]))
    save_adapter(a, tmp_path / "ad")
    b = load_model("tiny-qwen3")
    add_adapter(b, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="lora_alpha=32 but this model's adapter has 8"):
        load_adapter(b, tmp_path / "ad")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decode_sized_lora_keeps_the_input_gradient_gpu():
    """A frozen adapter on a decode-sized input that needs a gradient (e.g. a reward model's input saliency)
    must not take the fused decode kernel, which has no backward: dX flows through the LoRA as through peft's."""
    model = load_model("tiny-qwen3", dtype=torch.float32, quant="int4", device="cuda")
    add_adapter(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    _randomize_adapter(model)
    layer = model.model.layers[0].self_attn.q_proj
    for p in model.parameters():
        p.requires_grad_(False)
    x = torch.randn(2, 1, layer.in_features, device="cuda", requires_grad=True)
    layer(x).square().sum().backward()
    a, b = layer.lora_A.detach(), layer.lora_B.detach()
    w = layer.base_layer.dequantize(torch.float32)
    ref = x.detach().clone().requires_grad_(True)
    (ref @ w.t() + layer.scaling * (ref @ a.t()) @ b.t()).square().sum().backward()
    torch.testing.assert_close(x.grad, ref.grad, rtol=1e-3, atol=1e-4)  # tf32 matmuls on the GPU
