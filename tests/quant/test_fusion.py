"""quant.fusion: input-sharing projections stored as row slices of one packed buffer and read as one matmul at
decode. Oracles: transformers on the dequantized weights, and the same model before fusion."""

import peft
import pytest
import torch

from orbit_lightning import add_adapter, export_hf_state_dict, load_model
from orbit_lightning.adapters.slots import adapters_disabled
from orbit_lightning.quant import dispatch
from orbit_lightning.quant.fusion import FusedRows, fuse_projections, fuse_rows, project
from orbit_lightning.quant.linear import QuantLinear
from tests.hf_models import hf_from_export, make_hf_model, padded_batch, save_hf_model

# Groups per model: qwen3 (2 layers): q/k/v + gate/up per layer; qwen3_moe: q/k/v only (routed experts stay
# grouped by expert); deepseek_v3 (first layer dense): q_a/kv_a per layer, the dense gate/up and the MoE layer's
# shared-expert gate/up.
MODELS = {"qwen3-gqa2": 4, "qwen3-gqa2-bias": 4, "qwen3_moe-top2": 2, "deepseek_v3-qlora": 4}


def _lora(model, seed=3):
    add_adapter(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)  # nonzero: the delta must reach every slice
    return model


def _packed_bytes(model) -> int:
    storages = {b.untyped_storage().data_ptr(): b.untyped_storage().nbytes() for b in model.buffers()}
    return sum(storages.values())


@pytest.mark.parametrize("name", list(MODELS))
def test_fused_decode_matches_unfused_and_transformers(name, tmp_path, monkeypatch):
    hf_name, bias = name.removesuffix("-bias"), name.endswith("-bias")  # q/k/v biases, added per slice
    src = save_hf_model(make_hf_model(hf_name, **({"attention_bias": True} if bias else {})), tmp_path / "src")
    model = load_model(src, quant="int4", dtype=torch.float32).eval()
    hf = hf_from_export(export_hf_state_dict(model, dtype=torch.float32), src, tmp_path / "deq")
    _lora(model)
    ids, mask, _ = padded_batch(hf.config.vocab_size, [5, 3], seed=7)  # 10 rows: the decode-sized bucket
    with torch.no_grad():
        before = model(ids, attention_mask=mask)
        bytes_before = _packed_bytes(model)
        assert fuse_projections(model) == MODELS[name]
        assert fuse_projections(model) == 0  # idempotent
        calls = []
        real_matmul = dispatch.dequant_matmul
        monkeypatch.setattr(dispatch, "dequant_matmul",
                            lambda x, layer, lora=None: calls.append(layer) or real_matmul(x, layer, lora))
        after = model(ids, attention_mask=mask)
    assert sum(isinstance(c, FusedRows) for c in calls) == MODELS[name]  # each group ran as one matmul
    assert _packed_bytes(model) == bytes_before  # the stacked buffers replace the members' ones
    real = mask.bool()
    # fp32 on the CPU: one matmul over stacked rows vs one per member differ only by summation order
    assert (after[real] - before[real]).abs().max().item() <= 1e-5
    # the adapter disabled: the base against transformers on the dequantized weights (as test_frozen_base)
    with torch.no_grad(), adapters_disabled(model):
        base = model(ids, attention_mask=mask)
        ref = hf(input_ids=ids, attention_mask=mask).logits
    assert (base[real] - ref[real]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("rows,fused_calls", [(40, 4), (66, 0)])
def test_the_bucket_bound_decides_which_batches_fuse(rows, fused_calls, tmp_path, monkeypatch):
    """Up to fusion.DECODE_ROWS (64) rows, a 40-row batch with LoRA takes one matmul per group (the adapters then by
    lora_add_many, past the GEMV) and matches the per-member forward; 66 rows stay per member."""
    from orbit_lightning.quant import fusion

    assert fusion.DECODE_ROWS == 64
    src = save_hf_model(make_hf_model("qwen3-gqa2"), tmp_path / "src")
    model = _lora(load_model(src, quant="int4", dtype=torch.float32).eval())
    ids, mask, _ = padded_batch(model.config.vocab_size, [rows // 2, rows // 2 - 3], seed=5)
    with torch.no_grad():
        before = model(ids, attention_mask=mask)
        fuse_projections(model)
        calls = []
        real_matmul = dispatch.dequant_matmul
        monkeypatch.setattr(dispatch, "dequant_matmul",
                            lambda x, layer, lora=None: calls.append(layer) or real_matmul(x, layer, lora))
        after = model(ids, attention_mask=mask)
    assert sum(isinstance(c, FusedRows) for c in calls) == fused_calls
    real = mask.bool()
    assert (after[real] - before[real]).abs().max().item() <= 1e-5  # fp32: summation order only


def test_members_are_views_and_training_keeps_per_layer_autograd(tmp_path):
    src = save_hf_model(make_hf_model("qwen3-gqa2"), tmp_path / "src")
    model = _lora(load_model(src, quant="int4", dtype=torch.float32))
    ids = torch.randint(0, model.config.vocab_size, (2, 4))

    def lora_grads():
        model.zero_grad()
        model(ids).float().pow(2).mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want = lora_grads()
    fuse_projections(model)
    attn = model.model.layers[0].self_attn
    q, k, v = attn.q_proj.base_layer, attn.k_proj.base_layer, attn.v_proj.base_layer
    stacked = q.fused_rows.packed()["weight_packed"]
    assert q.weight_packed.data_ptr() == stacked.data_ptr()
    assert k.weight_packed.data_ptr() == stacked[q.out_features].data_ptr()
    assert v.weight_scale.untyped_storage().data_ptr() == q.weight_scale.untyped_storage().data_ptr()
    got = lora_grads()  # autograd needed: each member's own dX-only backward, as before fusion
    assert want.keys() == got.keys() and all(torch.equal(want[n], got[n]) for n in want)


def test_project_falls_back_when_the_group_is_broken_and_fusion_heals_it(tmp_path):
    src = save_hf_model(make_hf_model("qwen3-gqa2"), tmp_path / "src")
    model = load_model(src, quant="int4", dtype=torch.float32)
    fuse_projections(model)
    mlp = model.model.layers[0].mlp
    x = torch.randn(1, 2, model.config.hidden_size)
    want = [mlp.gate_proj(x), mlp.up_proj(x)]
    mlp.gate_proj.weight_scale = mlp.gate_proj.weight_scale.clone()  # no longer a slice of the group
    assert not mlp.gate_proj.fused_rows.intact()
    assert all(torch.equal(a, b) for a, b in zip(project(x, (mlp.gate_proj, mlp.up_proj)), want))
    assert fuse_projections(model) == 1  # re-stacked from the current buffers
    assert mlp.gate_proj.fused_rows.intact()
    got = project(x, (mlp.gate_proj, mlp.up_proj))
    assert all((a - b).abs().max() <= 1e-5 for a, b in zip(got, want))


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_formats_without_per_row_tensors_are_not_fused(fmt):
    # fp8 scales cover 128-row blocks and nvfp4 carries a per-matrix scale: rows do not stack
    layers = [QuantLinear(256, n, fmt, dtype=torch.float32) for n in (128, 256)]
    assert fuse_rows(layers) is None
    assert fuse_rows([QuantLinear(64, 32, "int4"), torch.nn.Linear(64, 32)]) is None
    assert fuse_rows([QuantLinear(64, 32, "int4"), QuantLinear(128, 32, "int4")]) is None  # different inputs


# ---------------------------------------------------------------------------------------------- GPU
def _close_to_separate(got, want):
    # Fused vs per-layer: the base GEMV sums K in another split order before its one bf16 rounding (<= 1 ulp,
    # 2^-8 of the largest output), then identical LoRA deltas are added and rounded once more (<= 1 ulp).
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert (g.float() - w.float()).abs().max() <= 2.0**-7 * w.float().abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fused_qkv_and_gate_up_with_lora_match_per_layer_calls(tmp_path, monkeypatch):
    from orbit_lightning.kernels import gemm

    src = save_hf_model(make_hf_model("qwen3-gqa2"), tmp_path / "src")
    model = _lora(load_model(src, quant="int4", dtype=torch.bfloat16, device="cuda").eval())
    layer = model.model.layers[0]
    groups = [(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
              (layer.mlp.gate_proj, layer.mlp.up_proj)]  # fmt: skip
    xs = [torch.randn(1, m, model.config.hidden_size, device="cuda").bfloat16() for m in (1, 8)]
    with torch.no_grad():
        want = [[m(x) for m in grp] for grp in groups for x in xs]
        fuse_projections(model)
        calls = []
        real = gemm.gemv
        monkeypatch.setattr(gemm, "gemv", lambda *a: calls.append(a[6] and len(a[6].a)) or real(*a))
        got = [project(x, grp) for grp in groups for x in xs]
    assert calls == [3, 3, 2, 2]  # one GEMV launch per group and batch, every member's adapter riding in it
    for g, w in zip(got, want):
        _close_to_separate(g, w)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_tall_fused_group_takes_one_mma_gemv(monkeypatch):
    from orbit_lightning.kernels import configs, gemm

    g = torch.Generator(device="cuda").manual_seed(0)
    layers = [QuantLinear(2048, 12288, "int4").cuda() for _ in range(2)]
    for m in layers:
        m.random_init(g)
    x = torch.randn(1, 2048, device="cuda").bfloat16()
    with torch.no_grad():
        want = [m(x) for m in layers]
        assert fuse_rows(layers) is not None
        picked = []
        real = gemm.pick_gemv
        monkeypatch.setattr(gemm, "pick_gemv", lambda *a: picked.append(real(*a)) or picked[-1])
        got = project(x, layers)
    assert picked == [configs._GEMV_MMA]  # one launch for the 24576 stacked rows at M = 1 (kernels/gemv_mma.py)
    _close_to_separate(got, want)


def test_layers_fusion_cannot_serve_keep_their_own_forward(monkeypatch):
    # An OFT adapter rotates each layer's input: the stacked matmul would skip that, so those groups run per layer
    # (bitwise as before), while groups of plain LoRA-free members (gate/up here) still take the stacked matmul.
    model = load_model("tiny-qwen3", quant="int4", dtype=torch.float32).eval()
    add_adapter(model, peft.OFTConfig(oft_block_size=16, target_modules=["q_proj", "k_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("oft_R"):
                p.copy_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    ids = torch.randint(0, 256, (2, 3), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(ids)
        fuse_projections(model)
        calls = []
        real = dispatch.dequant_matmul
        monkeypatch.setattr(dispatch, "dequant_matmul",
                            lambda x, layer, lora=None: calls.append(layer) or real(x, layer, lora))
        got = model(ids)
    fused = [c for c in calls if isinstance(c, FusedRows)]
    assert len(fused) == model.config.num_hidden_layers  # gate/up only
    assert all(c.members[0] is layer.mlp.gate_proj for c, layer in zip(fused, model.model.layers))
    assert (got - want).abs().max() <= 1e-5
