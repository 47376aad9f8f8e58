"""`kernels.sample`: the batched exponential-race sampler (interpreter on the CPU, compiled on the GPU)."""

import math

import pytest
import torch

from orbit_lightning import kernels

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _args(b: int, temp: float, seed: int, device: str, steps=None):
    return (torch.full((b,), temp, device=device), torch.full((b,), seed, dtype=torch.long, device=device),
            torch.arange(b, device=device) if steps is None else steps)


@pytest.mark.parametrize("device", DEVICES)
def test_draws_follow_the_tempered_distribution(device):
    """800 draws (one per step) of a fixed 40-token distribution at T = 1.5: every token's frequency lies
    within 5 binomial standard deviations of its probability (a false alarm is < 1e-5 per token)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 40, generator=g) * 2
    n = 800
    tok = kernels.sample(logits.expand(n, 40).contiguous().to(device), *_args(n, 1.5, 77, device))
    freq = torch.bincount(tok.cpu(), minlength=40).double() / n
    p = (logits[0].double() / 1.5).softmax(-1)
    assert ((freq - p).abs() <= 5 * (p * (1 - p) / n).sqrt() + 1e-3).all()


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_rows_take_the_first_argmax(device):
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, -1.0, 5.0, 5.0]], device=device)
    tok = kernels.sample(logits, torch.zeros(2, device=device), torch.zeros(2, dtype=torch.long, device=device),
                         torch.zeros(2, dtype=torch.long, device=device))
    assert tok.tolist() == [1, 0]
    wide = torch.zeros(1, 5000, device=device)
    wide[0, [4100, 2500, 100]] = 7.0  # ties across vocabulary chunks: the lowest index wins
    zeros = torch.zeros(1, dtype=torch.long, device=device)
    assert kernels.sample(wide, torch.zeros(1, device=device), zeros, zeros).item() == 100


@pytest.mark.parametrize("device", DEVICES)
def test_a_row_depends_on_its_seed_and_step_only(device):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 3000, generator=g).to(device)  # > one 1024-wide block: the cross-lane argmax
    temp = torch.tensor([1.0, 0.7, 1.0, 2.0, 1.0, 1.0], device=device)
    seeds = torch.tensor([5, 5, 6, 7, 8, 9], device=device)
    steps = torch.tensor([0, 3, 3, 1, 0, 2], device=device)
    full = kernels.sample(logits, temp, seeds, steps)
    assert torch.equal(full, kernels.sample(logits, temp, seeds, steps))  # deterministic
    perm = torch.tensor([4, 2, 0, 5, 1, 3], device=device)
    assert torch.equal(kernels.sample(logits[perm], temp[perm], seeds[perm], steps[perm]), full[perm])
    alone = [kernels.sample(logits[i : i + 1], temp[i : i + 1], seeds[i : i + 1], steps[i : i + 1]) for i in range(6)]
    assert torch.equal(torch.cat(alone), full)
    # a different step (or seed) of the same row draws afresh: over 64 steps, several different tokens
    many = kernels.sample(logits[:1].expand(64, -1).contiguous(), *_args(64, 1.0, 5, device))
    assert len(set(many.tolist())) > 8


@pytest.mark.parametrize("device", DEVICES)
def test_masked_tokens_are_never_drawn(device):
    logits = torch.full((200, 50), float("-inf"), device=device)
    logits[:, [3, 17, 41]] = torch.tensor([0.0, 1.0, 2.0], device=device)
    tok = kernels.sample(logits, *_args(200, 1.0, 3, device))
    assert set(tok.tolist()) <= {3, 17, 41} and len(set(tok.tolist())) == 3


def test_shape_errors():
    with pytest.raises(ValueError, match="seeds must be a \\[2\\]"):
        kernels.sample(torch.zeros(2, 5), torch.ones(2), torch.zeros(3, dtype=torch.long),
                       torch.zeros(2, dtype=torch.long))


def test_binomial_bound_is_meaningful():
    """The frequency test above can fail: a wrong temperature (T = 1 draws) violates its bound."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 40, generator=g) * 2
    n = 800
    tok = kernels.sample(logits.expand(n, 40).contiguous(), *_args(n, 1.0, 77, "cpu"))
    freq = torch.bincount(tok, minlength=40).double() / n
    p = (logits[0].double() / 1.5).softmax(-1)
    assert not ((freq - p).abs() <= 5 * (p * (1 - p) / n).sqrt() + 1e-3).all()
    assert math.isfinite(freq.sum().item())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_the_untempered_log_softmax_at_the_drawn_tokens(device, dtype):
    """logprobs=True draws the same tokens and adds log-softmax(logits in fp32)[token], checked against fp64.
    Bound: the fp32 sums are trees (Triton reductions) of <= 2048 terms per chunk, then of the chunks, each exp /
    log adding an ulp: under 32 * 2^-24 relative to 1 + |logsumexp| (rows of 5000: three chunks, one partial;
    masked -inf entries, a greedy row and a tempered one)."""
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(3, 5000, generator=g) * 4).to(dtype)
    logits[1, ::7] = float("-inf")
    temp = torch.tensor([0.0, 0.7, 1.3], device=device)
    seeds, steps = torch.tensor([1, 2, 3], device=device), torch.tensor([5, 6, 7], device=device)
    x = logits.to(device)
    tok, lp = kernels.sample(x, temp, seeds, steps, logprobs=True)
    assert torch.equal(tok, kernels.sample(x, temp, seeds, steps))
    ref = logits.double().log_softmax(-1)
    want = ref.gather(1, tok.cpu()[:, None])[:, 0]
    lse = logits.double().logsumexp(-1)
    assert lp.dtype == torch.float32 and lp.shape == (3,)
    assert ((lp.cpu().double() - want).abs() <= 32 * 2.0**-24 * (1 + lse.abs())).all(), (lp, want)
