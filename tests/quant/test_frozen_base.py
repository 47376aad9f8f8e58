"""The frozen packed base: logits vs transformers on the dequantized weights, dX-only backward, bounded MoE
transients, and the quantization error of each format."""

import peft
import pytest
import torch

from orbit_lightning import add_adapter, export_hf_state_dict, load_model
from orbit_lightning.models.moe import Experts
from orbit_lightning.quant.experts import QuantExperts
from orbit_lightning.quant.linear import QuantLinear
from tests.hf_models import hf_from_export, make_hf_model, padded_batch, save_hf_model
from tests.memory_tracker import LiveTensorTracker

FORMATS = ["int4", "int4-g64", "fp8", "mxfp4", "nvfp4", "nf4"]
MODELS = ["qwen3-gqa2", "qwen3_moe-top2", "deepseek_v3-qlora"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", MODELS)
def test_quantized_model_matches_transformers_on_dequantized_weights(name, fmt, tmp_path):
    src = save_hf_model(make_hf_model(name), tmp_path / "src")
    ours = load_model(src, quant=fmt, dtype=torch.float32)
    n_packed = sum(isinstance(m, (QuantLinear, QuantExperts)) for m in ours.modules())
    assert n_packed > 0 and not any(type(m) is torch.nn.Linear and "lm_head" not in n
                                    for n, m in ours.named_modules())
    hf = hf_from_export(export_hf_state_dict(ours, dtype=torch.float32), src, tmp_path / "deq")
    ids, mask, pos = padded_batch(hf.config.vocab_size, [8, 3, 6], seed=7)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        got = ours(ids, attention_mask=mask)
    real = mask.bool()
    assert (got[real] - ref[real]).abs().max().item() <= 1e-4


def test_packed_export_roundtrips_through_a_prequantized_checkpoint(tmp_path):
    """dequantize=False exports compressed-tensors tensors; a checkpoint made of them loads as is (no requant), and
    into int4-tiled's layout."""
    import json

    from safetensors.torch import save_file

    # (every packed weight 256 wide: whole int4-tiled blocks, for the last part)
    src = save_hf_model(make_hf_model("qwen3_moe-top2", hidden_size=256, intermediate_size=256, head_dim=64,
                                      moe_intermediate_size=256), tmp_path / "src")
    ours = load_model(src, quant="int4", dtype=torch.float32)
    packed = export_hf_state_dict(ours, dequantize=False)
    assert "model.layers.0.self_attn.q_proj.weight_packed" in packed
    assert "model.layers.0.mlp.experts.3.down_proj.weight_scale" in packed
    out = tmp_path / "ct"
    out.mkdir()
    save_file({k: v.contiguous() for k, v in packed.items()}, out / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}},
        "ignore": ["lm_head"]}
    (out / "config.json").write_text(json.dumps(cfg))
    again = load_model(out, dtype=torch.float32)  # (int4_layout=auto: row-major on the CPU)
    assert {m.fmt.name for m in again.modules() if hasattr(m, "fmt")} == {"int4"}
    for (k, a), b in zip(packed.items(), export_hf_state_dict(again, dequantize=False).values()):
        assert torch.equal(a, b), k
    with pytest.raises(ValueError, match="already quantized"):
        load_model(out, quant="fp8")
    # The same checkpoint into the tiled layout of its int4 (the same values, reordered as they load; its shapes
    # make whole blocks), and out again as compressed-tensors' row-major tensors.
    # (by name, or as int4_layout=tiled asks of the checkpoint's own int4: what auto does on CUDA)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    for tiled in (load_model(out, quant="int4-tiled", dtype=torch.float32),
                  load_model(out, int4_layout="tiled", dtype=torch.float32)):
        assert {m.fmt.name for m in tiled.modules() if hasattr(m, "fmt")} == {"int4-tiled"}
        for (k, a), b in zip(packed.items(), export_hf_state_dict(tiled, dequantize=False).values()):
            assert torch.equal(a, b), k
        with torch.no_grad():
            assert torch.equal(tiled(ids), again(ids))


def test_only_adapter_receives_gradients():
    model = load_model("tiny-qwen3-moe", quant="int4", dtype=torch.float32)
    add_adapter(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj", "gate_proj",
                                                                           "up_proj", "down_proj"]))
    ids = torch.randint(0, 256, (2, 12))
    model(ids).float().logsumexp(-1).mean().backward()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    for n, p in model.named_parameters():
        assert (p.grad is not None) == (n in trainable), n
    assert all(b.grad is None for b in model.buffers())
    lora_b = [p for n, p in model.named_parameters() if n.endswith("lora_B")]
    assert all(p.grad.abs().sum() > 0 for p in lora_b)


def _dequant_peak(fn) -> int:
    with torch.no_grad(), LiveTensorTracker() as tracker:
        fn()
    return tracker.peak


def test_backward_allocates_no_weight_gradient():
    """dX-only: backward costs one transient dequantization of W (as the forward does), never W + dW."""
    k = n = 1024
    layer = QuantLinear.from_linear(torch.nn.Linear(k, n, bias=False), "int4")
    layer.compute_dtype = torch.float32
    x = torch.randn(4, k, requires_grad=True)
    y = layer(x)
    one_dequant = _dequant_peak(layer.dequantize)
    with LiveTensorTracker() as tracker:
        y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    dw_bytes = k * n * 4
    assert tracker.peak <= one_dequant + 2 * x.numel() * 4 < one_dequant + dw_bytes, (tracker.peak, one_dequant)


@pytest.mark.parametrize("chunk", [1, 4])
def test_moe_transients_bounded_by_one_chunk(chunk):
    """Forward and backward of packed experts keep at most one chunk's dequantized projection alive."""
    e, d, i = 16, 256, 512
    dense = Experts(e, d, i)
    for p in dense.parameters():
        torch.nn.init.normal_(p, std=0.02)
    experts = QuantExperts.from_experts(dense, "int4")
    experts.compute_dtype, experts.chunk = torch.float32, chunk
    t, topk = 16, 2
    x = torch.randn(t, d, requires_grad=True)
    ids = torch.arange(t * topk).view(t, topk) % e  # every expert active
    w = torch.rand(t, topk)
    one_chunk = _dequant_peak(lambda: experts.dequantize("down_proj", torch.arange(chunk), torch.float32))
    all_experts = _dequant_peak(lambda: [experts.dequantize(p, None, torch.float32) for p in Experts.PROJECTIONS])
    activations = 16 * t * topk * max(d, i) * 4  # routed rows, gate/up/hidden, their grads: a few per row
    with LiveTensorTracker() as tracker:
        experts(x, ids, w).pow(2).sum().backward()
    assert tracker.peak <= one_chunk + activations, (tracker.peak, one_chunk)
    assert tracker.peak < all_experts / 3


def test_chunking_changes_no_bit_of_the_moe_forward_or_its_gradients():
    """However the active experts are chunked (one chunk by the default budget, or a few at a time), every
    expert multiplies the same rows by the same weights: outputs and gradients are bitwise equal. Without autograd
    (decode) the combine gathers in another layout: the same values too."""
    e, d, i = 7, 64, 32
    _, experts = _dense_and_packed_experts(e, d, i, "int4", std=0.02)
    t, topk = 23, 3
    g = torch.Generator().manual_seed(5)
    x0 = torch.randn(t, d, generator=g)
    ids = torch.rand(t, e, generator=g).topk(topk, dim=-1).indices
    ids[ids == 4] = 5  # expert 4 gets no rows
    w = torch.rand(t, topk, generator=g)
    runs = []
    for chunk in (0, 1, 2, 3):
        experts.chunk = chunk
        x = x0.clone().requires_grad_()
        y = experts(x, ids, w)
        y.pow(2).sum().backward()
        with torch.no_grad():
            assert torch.equal(experts(x0, ids, w), y)
        runs.append((y.detach(), x.grad))
    assert experts.chunk_size(t * topk, x0.device) == 3
    for y, dx in runs[1:]:
        assert torch.equal(y, runs[0][0]) and torch.equal(dx, runs[0][1])


def _dense_and_packed_experts(e: int, d: int, i: int, fmt: str, std: float) -> tuple[Experts, QuantExperts]:
    """Random fp32 experts and their packed copy, computing in fp32."""
    dense = Experts(e, d, i)
    for p in dense.parameters():
        torch.nn.init.normal_(p, std=std)
    q = QuantExperts.from_experts(dense, fmt)
    q.compute_dtype = torch.float32
    return dense, q


def test_dequantized_moe_matches_dense_experts_in_fp32():
    e, d, i = 6, 64, 32
    dense, q = _dense_and_packed_experts(e, d, i, "fp8", std=0.05)
    for proj in Experts.PROJECTIONS:  # reference: the same routing over the dequantized weights
        getattr(dense, proj).data.copy_(q.dequantize(proj, None, torch.float32))
    x, ids = torch.randn(10, d), torch.randint(0, e, (10, 2))
    w = torch.rand(10, 2)
    with torch.no_grad():
        assert (q(x, ids, w) - dense(x, ids, w)).abs().max() <= 1e-5


def test_prequantized_checkpoint_keeps_its_ignored_layers_unpacked(tmp_path):
    """compressed-tensors `ignore` (here: attention kept in bf16) is honoured: no silent re-quantization."""
    import json

    from safetensors.torch import save_file

    src = save_hf_model(make_hf_model("qwen3_moe-top2"), tmp_path / "src")
    packed = load_model(src, quant="int4", dtype=torch.float32)
    dense = load_model(src, dtype=torch.float32)
    tensors = {k: v for k, v in export_hf_state_dict(packed, dequantize=False).items() if "self_attn" not in k}
    tensors.update({k: v for k, v in export_hf_state_dict(dense).items() if "self_attn" in k})
    out = tmp_path / "ct"
    out.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}},
        "ignore": ["lm_head", "re:.*self_attn.*"]}
    (out / "config.json").write_text(json.dumps(cfg))
    loaded = load_model(out, dtype=torch.float32)
    q = loaded.model.layers[0].self_attn.q_proj
    assert type(q) is torch.nn.Linear
    assert torch.equal(q.weight, dense.model.layers[0].self_attn.q_proj.weight)
    assert isinstance(loaded.model.layers[0].mlp.experts, QuantExperts)
