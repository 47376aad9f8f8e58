"""Sampling maths against hand-computed masks and exact probabilities (pure functions, no model)."""

import math

import torch

from orbit_lightning.rollout.sampling import (
    make_generator,
    mask_top_k_top_p,
    sample_seed,
    sample_tokens,
    sampled_logprobs,
)

LOGITS = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3]]))  # sorted order: 1 (.4), 3 (.3), 2 (.2), 0 (.1)
NEG = float("-inf")


def test_top_k_keeps_k_most_likely():
    out = mask_top_k_top_p(LOGITS, torch.tensor([2]), torch.tensor([1.0]))
    assert torch.isinf(out[0, [0, 2]]).all() and torch.equal(out[0, [1, 3]], LOGITS[0, [1, 3]])


def test_top_p_keeps_smallest_prefix_reaching_p():
    # Cumulative mass .4, .7, .9, 1.0: p = .7 keeps {1, 3}; p = .71 also needs token 2; tiny p keeps the argmax.
    for p, kept in ((0.7, [1, 3]), (0.71, [1, 2, 3]), (1e-6, [1])):
        out = mask_top_k_top_p(LOGITS, torch.tensor([0]), torch.tensor([p]))
        assert sorted(torch.isfinite(out[0]).nonzero().flatten().tolist()) == kept, p


def test_top_p_applies_after_top_k_renormalisation():
    # top-k 3 leaves {1: .4, 3: .3, 2: .2} -> renormalised .444, .333, .222; p = .7 now needs 2 tokens (.778).
    out = mask_top_k_top_p(LOGITS, torch.tensor([3]), torch.tensor([0.7]))
    assert sorted(torch.isfinite(out[0]).nonzero().flatten().tolist()) == [1, 3]


def test_rows_use_their_own_settings():
    logits = LOGITS.repeat(2, 1)
    out = mask_top_k_top_p(logits, torch.tensor([1, 0]), torch.tensor([1.0, 1.0]))
    assert torch.isfinite(out[0]).sum() == 1 and torch.isfinite(out[1]).all()


def test_greedy_rows_take_argmax_without_generator():
    logits = torch.randn(3, 11)
    toks = sample_tokens(logits, torch.zeros(3), torch.zeros(3, dtype=torch.long), torch.ones(3), [None] * 3)
    assert torch.equal(toks, logits.argmax(-1))


def test_exponential_race_samples_the_tempered_distribution():
    n = 20000
    temp = 0.5
    logits = LOGITS.repeat(n, 1)
    gens = [make_generator(sample_seed(1, i), torch.device("cpu")) for i in range(n)]
    toks = sample_tokens(logits, torch.full((n,), temp), torch.zeros(n, dtype=torch.long), torch.ones(n), gens)
    freq = torch.bincount(toks, minlength=4).double() / n
    want = (LOGITS[0].double() / temp).softmax(-1)
    # 5 standard errors of a binomial proportion: fails only if the sampler is biased.
    se = (want * (1 - want) / n).sqrt()
    assert ((freq - want).abs() <= 5 * se).all(), (freq, want)


def test_same_generator_seed_same_tokens_regardless_of_other_rows():
    logits = torch.randn(4, 50)
    def run(rows):
        gens = [make_generator(sample_seed(9, r), torch.device("cpu")) for r in rows]
        return sample_tokens(logits[rows], torch.ones(len(rows)), torch.zeros(len(rows), dtype=torch.long),
                             torch.ones(len(rows)), gens)
    both = run([0, 1, 2, 3])
    assert both[2] == run([2])[0] and both[0] == run([0, 3])[0]


def test_sample_seeds_are_distinct_and_in_range():
    seeds = {sample_seed(s, j) for s in range(50) for j in range(50)}
    assert len(seeds) == 2500 and all(0 <= x < 2**63 for x in seeds)
    assert sample_seed(-3, 1) >= 0


def test_logprobs_are_untempered_log_softmax():
    logits = torch.randn(5, 13)
    toks = torch.tensor([0, 3, 12, 7, 7])
    ref = torch.log_softmax(logits.double(), -1).gather(-1, toks[:, None])[:, 0]
    got = sampled_logprobs(logits, toks)
    assert got.dtype == torch.float32
    assert (got.double() - ref).abs().max() < 1e-6
    assert math.isclose(sampled_logprobs(LOGITS, torch.tensor([1]))[0].item(), math.log(0.4), rel_tol=1e-6)
