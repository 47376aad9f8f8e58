"""KL estimators (exact expectations over a small vocab), KL reward penalty, and entropy vs fp64 softmax."""

import math

import pytest
import torch

from orbit_lightning.algorithms import (
    entropy_from_logits,
    entropy_from_logits_chunked,
    kl_estimate,
    kl_penalized_rewards,
)

F64 = torch.float64


def test_kl_estimators_hand_computed():
    # pi = 0.5, pi_ref = 0.25 -> x = log(ref/pi) = -log 2
    lp = torch.tensor([[math.log(0.5)]])
    ref = torch.tensor([[math.log(0.25)]])
    ln2 = math.log(2)
    assert kl_estimate(lp, ref, "k1").item() == pytest.approx(ln2)
    assert kl_estimate(lp, ref, "k2").item() == pytest.approx(0.5 * ln2**2)
    assert kl_estimate(lp, ref, "k3").item() == pytest.approx(0.5 - 1 + ln2)


def test_k1_k3_expectations_equal_exact_kl():
    # Unbiasedness, checked exactly: E_{y~p}[k(y)] = sum_y p(y) k(y) must equal KL(p || q).
    g = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(3, 11, generator=g, dtype=F64), -1)
    logq = torch.log_softmax(torch.randn(3, 11, generator=g, dtype=F64), -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    for kind in ("k1", "k3"):
        expectation = (logp.exp() * kl_estimate(logp, logq, kind)).sum(-1)
        torch.testing.assert_close(expectation, kl, rtol=1e-12, atol=1e-12)
    # k2 is biased but its expectation is >= 0 and matches KL to second order when p ~ q
    near = torch.log_softmax(logp + 1e-3 * torch.randn(3, 11, generator=g, dtype=F64), -1)
    kl_near = (logp.exp() * (logp - near)).sum(-1)
    k2 = (logp.exp() * kl_estimate(logp, near, "k2")).sum(-1)
    torch.testing.assert_close(k2, kl_near, rtol=1e-2, atol=0)


def test_k3_small_ratio_precision_and_nonnegativity():
    # x = 1e-4: k3 = x^2/2 - x^3/6 + ... ~ 5e-9; a naive exp(x) - 1 - x in float32 returns ~0 or noise
    x = torch.tensor([[1e-4, -1e-4, 0.0]])
    k3 = kl_estimate(torch.zeros(1, 3), x, "k3")
    ref = torch.expm1(x.double()) - x.double()
    torch.testing.assert_close(k3.double(), ref, rtol=1e-3, atol=0)
    assert (k3 >= 0).all()


def test_k3_clamps_extreme_log_ratio():
    lp = torch.tensor([[-150.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[0.0, -1.0]])
    k3 = kl_estimate(lp, ref, "k3")
    assert k3[0, 0].item() == pytest.approx(math.expm1(20.0) - 20.0, rel=1e-6)
    k3.sum().backward()
    assert torch.isfinite(lp.grad).all() and lp.grad[0, 0] == 0


def test_kl_estimate_errors():
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_estimate(torch.zeros(1, 2), torch.zeros(1, 2), "k4")
    with pytest.raises(ValueError, match="ref_logprobs"):
        kl_estimate(torch.zeros(1, 2), torch.zeros(1, 3))


def test_kl_penalized_rewards_hand_computed():
    # k1 per token = logprob - ref. Row 0: 0.5 + 0.25 (third token masked) -> 1 - 0.1 * 0.75
    # Row 1: -0.5 + 0 + 1.0 = 0.5 -> 2 - 0.1 * 0.5
    lp = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -1.0, -0.5]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.25, -9.0], [-1.5, -1.0, -1.5]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    out = kl_penalized_rewards(torch.tensor([1.0, 2.0]), lp, ref, mask, beta=0.1)
    torch.testing.assert_close(out, torch.tensor([1 - 0.075, 2 - 0.05]))
    assert not out.requires_grad and out.dtype == torch.float32
    with pytest.raises(ValueError, match="beta"):
        kl_penalized_rewards(torch.zeros(2), lp, ref, mask, beta=-1.0)


def _entropy_fp64(logits):
    p = torch.softmax(logits.double(), -1)
    return -(p * torch.log(p)).sum(-1)


def test_entropy_matches_fp64_softmax():
    g = torch.Generator().manual_seed(1)
    logits = 8 * torch.randn(2, 3, 50, generator=g)  # peaked and flat rows
    h = entropy_from_logits(logits)
    assert h.shape == (2, 3) and h.dtype == torch.float32
    # float32 log_softmax of |z| ~ 30: absolute error a few ulp(30) ~ 1e-5 at most
    torch.testing.assert_close(h.double(), _entropy_fp64(logits), rtol=0, atol=2e-5)


def test_entropy_special_cases():
    V = 7
    assert entropy_from_logits(torch.zeros(V)).item() == pytest.approx(math.log(V))
    # large shift: softmax is shift-invariant, so is the entropy
    z = torch.randn(V)
    assert entropy_from_logits(z + 1e4).item() == pytest.approx(entropy_from_logits(z).item(), abs=1e-3)
    # -inf (filtered) logits contribute 0 and give no NaN in value or grad
    logits = torch.tensor([[0.0, float("-inf"), 0.0, float("-inf")]], requires_grad=True)
    h = entropy_from_logits(logits)
    assert h.item() == pytest.approx(math.log(2))
    h.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_entropy_gradient_matches_fp64_autograd():
    g = torch.Generator().manual_seed(2)
    base = torch.randn(4, 9, generator=g, dtype=F64)
    a = base.clone().requires_grad_(True)
    entropy_from_logits(a).sum().backward()
    b = base.clone().requires_grad_(True)
    _entropy_fp64(b).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)


def test_chunked_entropy_equals_unchunked_values_and_grads():
    g = torch.Generator().manual_seed(3)
    base = 3 * torch.randn(3, 5, 16, generator=g)  # 15 rows, chunk 4 leaves a ragged last chunk
    a = base.clone().requires_grad_(True)
    b = base.clone().requires_grad_(True)
    ha, hb = entropy_from_logits(a), entropy_from_logits_chunked(b, chunk=4)
    torch.testing.assert_close(hb, ha, rtol=0, atol=0)
    (ha * torch.arange(15.0).view(3, 5)).sum().backward()
    (hb * torch.arange(15.0).view(3, 5)).sum().backward()
    torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-7)


def test_chunked_entropy_keeps_no_softmax_for_backward():
    # Checkpointed chunks save only views of the logits themselves; the unchunked version saves its
    # float32 log-probabilities, i.e. new [rows, V] memory.
    logits = torch.randn(24, 32, requires_grad=True)

    def saved_storages(fn):
        saved = []

        def pack(t):
            saved.append(t.untyped_storage().data_ptr())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn(logits)
        return out, saved

    _, plain = saved_storages(entropy_from_logits)
    assert any(ptr != logits.untyped_storage().data_ptr() for ptr in plain)
    h, chunked = saved_storages(lambda x: entropy_from_logits_chunked(x, chunk=4))
    assert chunked and all(ptr == logits.untyped_storage().data_ptr() for ptr in chunked)
    h.sum().backward()  # recomputation in backward works
    assert torch.isfinite(logits.grad).all()


def test_chunked_entropy_bf16_and_no_grad():
    g = torch.Generator().manual_seed(4)
    logits = (4 * torch.randn(10, 40, generator=g)).bfloat16()
    with torch.no_grad():
        h = entropy_from_logits_chunked(logits, chunk=3)
    assert h.dtype == torch.float32
    torch.testing.assert_close(h.double(), _entropy_fp64(logits), rtol=0, atol=2e-5)
    with pytest.raises(ValueError, match="chunk"):
        entropy_from_logits_chunked(logits, chunk=0)
