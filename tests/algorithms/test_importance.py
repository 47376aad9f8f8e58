"""TIS / MIS importance weights against hand-computed values."""

import math

import pytest
import torch

from orbit_lightning.algorithms import importance_weights


def _token_case():
    # pi_old / mu = [0.5, 1, 3]
    rollout = torch.tensor([[-1.0, -2.0, -3.0]])
    old = rollout + torch.log(torch.tensor([[0.5, 1.0, 3.0]]))
    return old, rollout, torch.ones(1, 3, dtype=torch.bool)


def test_token_tis_hand_computed():
    old, rollout, mask = _token_case()
    w, keep, metrics = importance_weights(old, rollout, mask, method="tis", level="token", cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.0, 2.0]]))
    assert torch.equal(keep, mask)
    assert metrics["is_capped_frac"].item() == pytest.approx(1 / 3)
    assert metrics["is_ratio_max"].item() == pytest.approx(3.0)
    assert metrics["is_weight_mean"].item() == pytest.approx(3.5 / 3)
    # |log 0.5| + 0 + log 3 over 3 tokens
    assert metrics["logprob_abs_diff_mean"].item() == pytest.approx((math.log(2) + math.log(3)) / 3)


def test_token_mis_hand_computed():
    old, rollout, mask = _token_case()
    w, keep, metrics = importance_weights(old, rollout, mask, method="mis", cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.0, 0.0]]))
    assert keep.tolist() == [[True, True, False]]
    w, keep, metrics = importance_weights(old, rollout, mask, method="mis", cap=2.0, lower=0.6)
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.0, 0.0]]))
    assert keep.tolist() == [[False, True, False]]
    assert metrics["is_capped_frac"].item() == pytest.approx(2 / 3)


def _sequence_case():
    # row 0: counted log-ratios [0.2, 0.3] (third token masked, garbage 5.0): sum 0.5, mean 0.25
    # row 1: log-ratios [0.5, 0.5, 0.5]: sum 1.5, mean 0.5
    log_ratio = torch.tensor([[0.2, 0.3, 5.0], [0.5, 0.5, 0.5]])
    rollout = torch.full((2, 3), -1.0)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    return rollout + log_ratio, rollout, mask


def test_sequence_level_weights():
    old, rollout, mask = _sequence_case()
    e = math.exp
    w, keep, _ = importance_weights(old, rollout, mask, method="tis", level="sequence", cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[e(0.5), e(0.5), 0.0], [2.0, 2.0, 2.0]]))
    assert torch.equal(keep, mask.bool())
    w, keep, metrics = importance_weights(old, rollout, mask, method="mis", level="sequence", cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[e(0.5), e(0.5), 0.0], [0.0, 0.0, 0.0]]))
    assert keep.tolist() == [[True, True, False], [False, False, False]]
    assert metrics["is_capped_frac"].item() == pytest.approx(3 / 5)
    w, keep, _ = importance_weights(old, rollout, mask, method="mis", level="geometric", cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[e(0.25), e(0.25), 0.0], [e(0.5)] * 3]))
    assert torch.equal(keep, mask.bool())


def test_weights_are_detached_and_long_sequences_stay_finite():
    rollout = torch.full((1, 300), -2.0)
    old = (rollout + 1.0).requires_grad_(True)  # summed log-ratio 300 would overflow exp
    w, keep, metrics = importance_weights(old, rollout, torch.ones(1, 300), level="sequence", cap=2.0)
    assert not w.requires_grad
    assert torch.equal(w, torch.full((1, 300), 2.0))
    assert all(math.isfinite(v.item()) for v in metrics.values())


def test_on_policy_weights_are_one():
    lp = -torch.rand(3, 4)
    for method in ("tis", "mis"):
        for level in ("token", "sequence", "geometric"):
            w, keep, m = importance_weights(lp, lp, torch.ones(3, 4), method=method, level=level)
            assert torch.equal(w, torch.ones(3, 4)) and keep.all()
            assert m["logprob_abs_diff_mean"].item() == 0


def test_importance_errors():
    lp = torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    with pytest.raises(ValueError, match="method"):
        importance_weights(lp, lp, mask, method="pis")
    with pytest.raises(ValueError, match="level"):
        importance_weights(lp, lp, mask, level="batch")
    with pytest.raises(ValueError, match="cap"):
        importance_weights(lp, lp, mask, cap=0.0)
    with pytest.raises(ValueError, match="lower applies"):
        importance_weights(lp, lp, mask, method="tis", lower=0.5)
    with pytest.raises(ValueError, match="lower must"):
        importance_weights(lp, lp, mask, method="mis", lower=3.0)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        importance_weights(lp, torch.zeros(2, 2), mask)


def test_inf_padding_off_the_mask_gives_zero_weight():
    old = torch.tensor([[-1.0, float("-inf")]])
    rollout = torch.tensor([[-1.5, float("-inf")]])
    mask = torch.tensor([[True, False]])
    for level in ("token", "sequence", "geometric"):
        w, _, metrics = importance_weights(old, rollout, mask, level=level)
        assert w[0, 1] == 0 and w[0, 0].item() == pytest.approx(math.exp(0.5))
        assert all(math.isfinite(v.item()) for v in metrics.values())
