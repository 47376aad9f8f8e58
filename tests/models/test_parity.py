"""Our decoders vs transformers' own implementations, loaded from real `save_pretrained` directories."""

import pytest
import torch

from orbit_lightning import load_model
from tests.hf_models import CONFIGS, make_hf_model, padded_batch, save_hf_model

TOL = 1e-4  # fp32 end to end; differences are summation order only (observed ~1e-6)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers(name, tmp_path):
    hf = make_hf_model(name)
    ours = load_model(save_hf_model(hf, tmp_path / name))
    ids, mask, pos = padded_batch(hf.config.vocab_size, [9, 9, 9])
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        got = ours(ids)
    assert (got - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_left_padding_matches_transformers(name, tmp_path):
    hf = make_hf_model(name, seed=1)
    ours = load_model(save_hf_model(hf, tmp_path / name))
    ids, mask, pos = padded_batch(hf.config.vocab_size, [11, 6, 1, 8], seed=2)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        got = ours(ids, attention_mask=mask)
    real = mask.bool()
    assert torch.isfinite(got).all()
    assert (got[real] - ref[real]).abs().max().item() <= TOL


def test_padding_does_not_change_a_sequence(tmp_path):
    """A sequence scored alone and inside a left-padded batch gets the same logits (no leakage from pads)."""
    hf = make_hf_model("qwen3_moe-top2")
    ours = load_model(save_hf_model(hf, tmp_path / "m"))
    ids, mask, _ = padded_batch(hf.config.vocab_size, [10, 4], seed=3)
    with torch.no_grad():
        batched = ours(ids, attention_mask=mask)[1, -4:]
        alone = ours(ids[1:, -4:])[0]
    assert (batched - alone).abs().max().item() <= 1e-5
