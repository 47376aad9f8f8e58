"""Policy losses and loss aggregation: hand-computed values, gradients, fp64 sequence-level GSPO reference."""

import math

import pytest
import torch

from orbit_lightning.algorithms import (
    POLICY_LOSSES,
    aggregate_loss,
    get_policy_loss,
    gspo_loss,
    ppo_loss,
)

F64 = torch.float64


def _ppo_case():
    # Token ratios r = [0.5, 1.0, 1.5, 1.1] in both rows; row 0 has A = +1, row 1 has A = -1.
    ratios = torch.tensor([0.5, 1.0, 1.5, 1.1], dtype=F64)
    old = torch.log(torch.tensor([[0.3, 0.2, 0.1, 0.4]] * 2, dtype=F64))
    logprobs = (old + ratios.log()).requires_grad_(True)
    return logprobs, old, torch.tensor([1.0, -1.0], dtype=F64), torch.ones(2, 4, dtype=torch.bool)


def test_ppo_clip_higher_and_dual_clip_hand_computed():
    logprobs, old, adv, mask = _ppo_case()
    loss, metrics = ppo_loss(logprobs, old, adv, mask, eps_low=0.2, eps_high=0.28, dual_clip=1.4)
    # A=+1: -min(r, clip(r, 0.8, 1.28)) = [-0.5, -1, -1.28 (clipped high), -1.1]
    # A=-1:  max(r, clip(r)) = [0.8 (clipped low), 1, 1.5 -> dual clip caps at c=1.4, 1.1]
    expected = torch.tensor([[-0.5, -1.0, -1.28, -1.1], [0.8, 1.0, 1.4, 1.1]], dtype=F64)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    # d loss / d logprob = -A * r where unclipped (dr/dlogprob = r), 0 where any clip is active
    loss.sum().backward()
    expected_grad = torch.tensor([[-0.5, -1.0, 0.0, -1.1], [0.0, 1.0, 0.0, 1.1]], dtype=F64)
    torch.testing.assert_close(logprobs.grad, expected_grad, rtol=1e-12, atol=1e-12)
    # one token of eight in each clip class; ratio mean = 2 * 4.1 / 8
    for key in ("clip_frac_low", "clip_frac_high", "dual_clip_frac"):
        assert metrics[key].item() == pytest.approx(1 / 8)
    assert metrics["ratio_mean"].item() == pytest.approx(4.1 / 4)
    assert metrics["ratio_max"].item() == pytest.approx(1.5)
    assert all(not v.requires_grad and v.dim() == 0 for v in metrics.values())


def test_ppo_symmetric_default_and_no_dual_clip():
    logprobs, old, adv, mask = _ppo_case()
    loss, metrics = ppo_loss(logprobs, old, adv, mask)  # eps 0.2 both sides, no dual clip
    expected = torch.tensor([[-0.5, -1.0, -1.2, -1.1], [0.8, 1.0, 1.5, 1.1]], dtype=F64)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    assert metrics["dual_clip_frac"].item() == 0


def test_ppo_on_policy_gradient_is_vanilla_policy_gradient():
    # ratio == 1: grad of token_mean(-A * r) wrt logprob_t is -A_i / n_tokens
    g = torch.Generator().manual_seed(0)
    logprobs = (-torch.rand(3, 5, generator=g)).requires_grad_(True)
    adv = torch.randn(3, generator=g)
    mask = torch.rand(3, 5, generator=g) > 0.3
    loss_tok, _ = ppo_loss(logprobs, logprobs.detach(), adv, mask)
    aggregate_loss(loss_tok, mask).backward()
    expected = -adv[:, None].expand(3, 5) * mask / mask.sum()
    torch.testing.assert_close(logprobs.grad, expected, rtol=1e-6, atol=1e-7)


def test_ppo_token_level_advantages_and_masked_tokens():
    logprobs, old, _, mask = _ppo_case()
    adv_tok = torch.tensor([[1.0, 1.0, 1.0, 1.0], [-1.0, -1.0, -1.0, -1.0]], dtype=F64)
    mask = mask.clone()
    mask[1, 0] = False  # the low-clipped token no longer counts
    loss_seq, _ = ppo_loss(logprobs, old, adv_tok[:, 0], mask)
    loss_tok, metrics = ppo_loss(logprobs, old, adv_tok, mask)
    torch.testing.assert_close(loss_tok, loss_seq)
    assert metrics["clip_frac_low"].item() == 0
    assert metrics["clip_frac_high"].item() == pytest.approx(1 / 7)


def test_ppo_huge_log_ratio_stays_finite():
    logprobs = torch.tensor([[0.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-200.0, -1.0]])  # log-ratio 200 would overflow exp in float32
    loss, metrics = ppo_loss(logprobs, old, torch.tensor([-1.0]), torch.ones(1, 2))
    aggregate_loss(loss, torch.ones(1, 2)).backward()
    assert torch.isfinite(loss).all() and torch.isfinite(logprobs.grad).all()
    assert math.isfinite(metrics["ratio_max"].item())


def _gspo_reference(logprobs, old, adv, mask, eps_low, eps_high):
    """Sequence-level GSPO objective as written in the paper, fp64, no GSPO-token trick."""
    m = mask.to(F64)
    s = torch.exp(((logprobs - old) * m).sum(-1) / m.sum(-1))
    per_seq = torch.maximum(-adv * s, -adv * s.clamp(1 - eps_low, 1 + eps_high))
    return per_seq.mean()


@pytest.mark.parametrize("scale", [1e-4, 0.3])  # 1e-4: mostly unclipped; 0.3: mostly clipped
def test_gspo_matches_sequence_level_objective(scale):
    g = torch.Generator().manual_seed(2)
    N, T = 6, 7
    old = -torch.rand(N, T, generator=g, dtype=F64)
    delta = scale * torch.randn(N, T, generator=g, dtype=F64)
    mask = torch.rand(N, T, generator=g) > 0.3
    mask[:, 0] = True
    adv = torch.randn(N, generator=g, dtype=F64)

    lp_a = (old + delta).requires_grad_(True)
    loss_tok, _ = gspo_loss(lp_a, old, adv, mask)
    ours = aggregate_loss(loss_tok, mask, "seq_mean_token_mean")
    ours.backward()

    lp_b = (old + delta).requires_grad_(True)
    ref = _gspo_reference(lp_b, old, adv, mask, 3e-4, 4e-4)
    ref.backward()
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lp_a.grad, lp_b.grad, rtol=1e-10, atol=1e-12)


def test_gspo_hand_computed_clip_and_length_normalisation():
    # seq 0: token log-ratios [0.1, -0.3, 0.2] -> mean 0 -> s = 1, unclipped
    # seq 1: counted log-ratios [0.3, 0.3] (third token masked, garbage) -> s = e^0.3, clipped at 1 + 4e-4
    old = torch.zeros(2, 3, dtype=F64)
    logprobs = torch.tensor([[0.1, -0.3, 0.2], [0.3, 0.3, 50.0]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([2.0, 1.0], dtype=F64)
    loss_tok, metrics = gspo_loss(logprobs, old, adv, mask)
    torch.testing.assert_close(loss_tok[0], torch.full((3,), -2.0, dtype=F64))
    torch.testing.assert_close(loss_tok[1, :2], torch.full((2,), -1.0004, dtype=F64))
    aggregate_loss(loss_tok, mask, "seq_mean_token_mean").backward()
    # seq 0: d/dlogprob_t of mean_seq(mean_tok(-A s)) = 1/2 * 1/3 * (-2 * 1); seq 1 clipped -> 0
    expected = torch.tensor([[-1 / 3] * 3, [0.0, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(logprobs.grad, expected, rtol=1e-12, atol=1e-12)
    assert metrics["clip_frac_high"].item() == pytest.approx(2 / 5)
    assert metrics["ratio_max"].item() == pytest.approx(math.exp(0.3))


def test_loss_input_validation():
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="advantages must be"):
        ppo_loss(lp, lp, torch.zeros(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="old_logprobs"):
        ppo_loss(lp, torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="mask"):
        ppo_loss(lp, lp, torch.zeros(2), torch.ones(3, 2))
    with pytest.raises(ValueError, match="eps_low"):
        ppo_loss(lp, lp, torch.zeros(2), torch.ones(2, 3), eps_low=1.0)
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_loss(lp, lp, torch.zeros(2), torch.ones(2, 3), dual_clip=0.9)
    with pytest.raises(TypeError, match="floating"):
        ppo_loss(lp.long(), lp, torch.zeros(2), torch.ones(2, 3))


def test_bf16_logprobs_are_computed_in_float32():
    lp = torch.full((1, 2), -1.0, dtype=torch.bfloat16)
    loss, _ = ppo_loss(lp, lp, torch.ones(1), torch.ones(1, 2))
    assert loss.dtype == torch.float32


def test_registry():
    assert get_policy_loss("ppo") is ppo_loss and get_policy_loss("gspo") is gspo_loss
    assert set(POLICY_LOSSES) >= {"ppo", "gspo"}
    with pytest.raises(ValueError, match="registered: gspo, ppo"):
        get_policy_loss("a2c")


LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)  # row 2 empty (invalid sample)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token_mean", (1 + 2 + 4) / 3),
        ("seq_mean_token_mean", ((1 + 2) / 2 + 4 / 1) / 2),  # empty row 2 excluded
        ("seq_mean_token_sum_norm", ((1 + 2) / 4 + 4 / 4) / 2),  # max_tokens = 4
    ],
)
def test_aggregate_loss_hand_computed(mode, expected):
    assert aggregate_loss(LOSS, MASK, mode, max_tokens=4).item() == pytest.approx(expected)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_aggregate_loss_microbatches_with_denominator_equal_full_batch(mode):
    g = torch.Generator().manual_seed(3)
    loss = torch.randn(6, 5, generator=g, dtype=F64)
    mask = torch.rand(6, 5, generator=g) > 0.4
    mask[:, 0] = True
    full = aggregate_loss(loss, mask, mode, max_tokens=8)
    count = mask.sum() if mode == "token_mean" else mask.any(-1).sum()
    parts = [aggregate_loss(loss[i : i + 2], mask[i : i + 2], mode, 8, denominator=count) for i in (0, 2, 4)]
    parts = sum(parts)
    torch.testing.assert_close(parts, full, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_aggregate_all_zero_mask_is_zero_with_grad_path(mode):
    loss = torch.tensor([[1.0, float("inf")], [float("nan"), 2.0]], requires_grad=True)
    out = aggregate_loss(loss, torch.zeros(2, 2), mode, max_tokens=2)
    assert out.item() == 0 and out.requires_grad
    out.backward()
    assert torch.equal(loss.grad, torch.zeros(2, 2))


def test_aggregate_loss_errors():
    with pytest.raises(ValueError, match="max_tokens"):
        aggregate_loss(LOSS, MASK, "seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="unknown loss aggregation mode"):
        aggregate_loss(LOSS, MASK, "sum")
    with pytest.raises(ValueError, match="mask"):
        aggregate_loss(LOSS, MASK[:2])


@pytest.mark.parametrize("name", ["ppo", "gspo"])
def test_inf_padding_off_the_mask_gives_finite_grads(name):
    logprobs = torch.tensor([[-1.0, float("-inf")]], requires_grad=True)
    old = torch.tensor([[-1.2, float("-inf")]])
    mask = torch.tensor([[True, False]])
    loss_tok, metrics = get_policy_loss(name)(logprobs, old, torch.tensor([1.0]), mask, eps_high=1.0)
    aggregate_loss(loss_tok, mask).backward()
    assert torch.isfinite(loss_tok).all() and torch.isfinite(logprobs.grad).all()
    assert logprobs.grad[0, 0] != 0 and logprobs.grad[0, 1] == 0
    assert all(torch.isfinite(v) for v in metrics.values())
