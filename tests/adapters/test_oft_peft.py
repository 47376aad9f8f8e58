"""Our OFT on our (dense or packed) base vs PEFT 0.21's OFT: the rotation module itself, and whole models
loaded with `peft.PeftModel.from_pretrained` on transformers' model carrying our exported dequantized base."""

import peft
import pytest
import torch
from peft.tuners.oft.layer import OFTRotationModule
from safetensors.torch import load_file
from torch import nn

from orbit_lightning import add_adapter, load_adapter, load_model, save_adapter
from orbit_lightning.adapters.oft import OftLinear, cayley, skew_symmetric
from orbit_lightning.adapters.slots import AdapterState
from orbit_lightning.quant.linear import QuantLinear
from tests.hf_models import make_hf_model, peft_oracle_max_diff, save_hf_model

TOL = 1e-4  # fp32 end to end
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def _randomize_adapter(model, seed=0, std=0.1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(std * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("neumann_terms", [None, 2, 3, 5, 7])
@pytest.mark.parametrize("block_share,coft", [(False, False), (True, False), (False, True)])
def test_rotation_matches_peft_module(neumann_terms, block_share, coft):
    """Layer level: our input rotation + base equals PEFT's OFTRotationModule followed by the same Linear."""
    torch.manual_seed(0)
    lin = nn.Linear(48, 10)
    ours = OftLinear(lin, AdapterState(), 16, block_share=block_share, neumann_terms=neumann_terms, coft=coft,
                     eps=0.3)
    with torch.no_grad():
        ours.oft_R.normal_(0.0, 0.1)
    ref = OFTRotationModule(1 if block_share else 3, 120, 16, 48, coft=coft, eps=0.3, block_share=block_share,
                            use_cayley_neumann=neumann_terms is not None,
                            num_cayley_neumann_terms=neumann_terms or 5)
    with torch.no_grad():
        ref.weight.copy_(ours.oft_R)
    x = torch.randn(2, 5, 48)
    # Without COFT the ops are PEFT's, in PEFT's order; COFT's norm clip is written differently (vector form).
    tol = 1e-6 if coft else 0.0
    assert (ours(x) - lin(ref(x))).abs().max().item() <= tol
    if coft:  # both projected their stored tensor in place, onto the same ball
        assert (ours.oft_R - ref.weight).abs().max().item() <= 1e-7
        assert (ours.oft_R.norm(dim=-1) * 2**0.5).max().item() <= 0.3 / 3**0.5 * (1 + 1e-6)


def test_exact_cayley_is_orthogonal_and_neumann_approximates_it():
    g = torch.Generator().manual_seed(1)
    block = 8
    triu = torch.triu_indices(block, block, 1)
    vec = 0.05 * torch.randn(4, block * (block - 1) // 2, generator=g)
    q = skew_symmetric(vec, triu, block)
    assert torch.equal(q, -q.transpose(-2, -1))
    r = cayley(q, None)
    eye = torch.eye(block).expand_as(r)
    assert (r.transpose(-2, -1) @ r - eye).abs().max().item() <= 2e-6  # fp32 precision
    # The Neumann branch approximates the transposed Cayley map (PEFT's convention), with error ~ |Q|^(n-1).
    err = [(cayley(q, n) - r.transpose(-2, -1)).abs().max().item() for n in (2, 5, 9)]
    assert err[0] > err[1] > err[2] and err[2] <= 1e-5


CASES = [
    ("qwen3-gqa2", None, ATTN + MLP, dict(oft_block_size=16)),
    ("qwen3-gqa2", "int4", ATTN + MLP, dict(oft_block_size=16, use_cayley_neumann=False)),
    ("qwen3-gqa2", "int4", ["q_proj", "down_proj"], dict(oft_block_size=0, r=4, block_share=True)),
    ("qwen3_moe-top2", None, ATTN, dict(oft_block_size=32, use_cayley_neumann=False)),
    ("qwen3_moe-top2", "int4", ATTN, dict(oft_block_size=16, coft=True, eps=0.5)),
]


@pytest.mark.parametrize("name,quant,targets,kw", CASES)
def test_saved_adapter_matches_peft(name, quant, targets, kw, tmp_path):
    src = save_hf_model(make_hf_model(name), tmp_path / "base")
    ours = load_model(src, quant=quant, dtype=torch.float32)
    add_adapter(ours, peft.OFTConfig(target_modules=targets, **kw))
    if quant:  # OFT wraps the packed layer and never unpacks it
        assert all(isinstance(m.base_layer, QuantLinear) for m in ours.modules() if isinstance(m, OftLinear))
    _randomize_adapter(ours)
    save_adapter(ours, tmp_path / "adapter")

    diff, moved, peft_keys = peft_oracle_max_diff(ours, src, tmp_path / "adapter", tmp_path)
    assert set(load_file(tmp_path / "adapter" / "adapter_model.safetensors")) == peft_keys  # PEFT's own keys
    assert diff <= TOL
    assert moved > 1e-3  # the adapter changes the output: the check is not vacuous


@pytest.mark.parametrize("quant", [None, "int4"])
def test_disable_adapter_gives_the_base_exactly(quant):
    plain = load_model("tiny-qwen3-moe", quant=quant, dtype=torch.float32)
    ours = load_model("tiny-qwen3-moe", quant=quant, dtype=torch.float32)
    add_adapter(ours, peft.OFTConfig(oft_block_size=16, target_modules=ATTN))
    _randomize_adapter(ours)
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert not torch.equal(ours(ids), plain(ids))
        with ours.disable_adapter():
            assert torch.equal(ours(ids), plain(ids))


@pytest.mark.parametrize("quant", [None, "int4"])
def test_only_oft_parameters_get_gradients(quant):
    model = load_model("tiny-qwen3", quant=quant, dtype=torch.float32)
    add_adapter(model, peft.OFTConfig(oft_block_size=16, target_modules=ATTN + MLP))
    _randomize_adapter(model)
    model(torch.randint(0, 256, (2, 6))).square().mean().backward()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith(".oft_R") for n in trainable)
    for n, p in model.named_parameters():
        assert (p.grad is not None and p.grad.abs().sum() > 0) if n in trainable else p.grad is None
    assert all(b.grad is None for b in model.buffers())  # packed base: buffers, never a gradient


def test_save_load_roundtrip_into_fresh_model(tmp_path):
    a = load_model("tiny-qwen3", quant="int4", dtype=torch.float32)
    add_adapter(a, peft.OFTConfig(oft_block_size=8, target_modules=["q_proj", "o_proj", "down_proj"]))
    _randomize_adapter(a, seed=3)
    save_adapter(a, tmp_path / "ad")
    b = load_adapter(load_model("tiny-qwen3", quant="int4", dtype=torch.float32), tmp_path / "ad")
    assert isinstance(b.model.layers[0].self_attn.q_proj, OftLinear)
    ids = torch.randint(0, 256, (2, 6))
    with torch.no_grad():
        assert torch.equal(a(ids), b(ids))


def test_bad_oft_configs():
    def add(preset, **kw):
        add_adapter(load_model(preset), peft.OFTConfig(**kw))

    with pytest.raises(ValueError, match="oft_block_size=24 does not divide in_features=64"):
        add("tiny-qwen3", oft_block_size=24, target_modules=["q_proj"])
    with pytest.raises(ValueError, match="r=3 does not divide in_features=64"):
        add("tiny-qwen3", oft_block_size=0, r=3, target_modules=["k_proj"])
    with pytest.raises(ValueError, match="module_dropout"):
        add("tiny-qwen3", oft_block_size=16, module_dropout=0.1, target_modules=["q_proj"])
    with pytest.raises(ValueError, match="routed experts"):
        add("tiny-qwen3-moe", oft_block_size=8, target_modules=["up_proj"])
