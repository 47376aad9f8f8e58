"""Unbiased pass@k against enumeration of k-subsets and exact integer binomials."""

import itertools
from fractions import Fraction
from math import comb

import pytest
import torch

from orbit_lightning.algorithms import pass_at_k


def test_matches_subset_enumeration():
    # pass@k = fraction of k-subsets of the n samples containing at least one correct sample
    for n in range(1, 7):
        for k in range(1, n + 1):
            expected = []
            for c in range(n + 1):
                subsets = list(itertools.combinations(range(n), k))  # samples 0..c-1 are the correct ones
                expected.append(sum(any(i < c for i in s) for s in subsets) / len(subsets))
            got = pass_at_k(torch.arange(n + 1), n, k)
            assert got.dtype == torch.float64
            torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("k", [1, 10, 100, 199])
def test_large_n_matches_exact_binomials(k):
    # C(200, 100) ~ 9e58: a naive float ratio of binomials would be fragile; exact Fractions are the oracle
    n = 200
    c = torch.arange(n + 1)
    exact = [float(1 - Fraction(comb(n - ci, k), comb(n, k))) for ci in range(n + 1)]
    expected = torch.tensor(exact, dtype=torch.float64)
    torch.testing.assert_close(pass_at_k(c, n, k), expected, rtol=1e-12, atol=1e-14)


def test_hand_values_and_exact_edges():
    assert pass_at_k(torch.tensor([1]), 2, 1).item() == 0.5  # one of two correct
    assert pass_at_k(torch.tensor([1]), 4, 2).item() == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    out = pass_at_k(torch.tensor([0, 4, 5, 8]), 8, 5)
    assert out[0].item() == 0.0  # no correct sample
    assert out[2].item() == 1.0 and out[3].item() == 1.0  # c > n - k: every 5-subset holds a correct one
    assert pass_at_k(torch.tensor([3.0]), 4, 1).item() == pytest.approx(0.75)  # integral floats accepted


def test_errors():
    with pytest.raises(ValueError, match="k must"):
        pass_at_k(torch.tensor([1]), 4, 5)
    with pytest.raises(ValueError, match="k must"):
        pass_at_k(torch.tensor([1]), 4, 0)
    with pytest.raises(ValueError, match=r"\[0, n = 4\]"):
        pass_at_k(torch.tensor([5]), 4, 1)
    with pytest.raises(ValueError, match="whole numbers"):
        pass_at_k(torch.tensor([1.5]), 4, 1)
    with pytest.raises(TypeError, match="integer"):
        pass_at_k(torch.tensor([True]), 4, 1)
    with pytest.raises(ValueError, match="1-D"):
        pass_at_k(torch.zeros(2, 2, dtype=torch.long), 4, 1)
