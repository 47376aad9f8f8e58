"""Unbiased pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", §2.1).

With n samples per problem of which c are correct, pass@k = 1 - C(n-c, k) / C(n, k). The binomials
overflow (C(1000, 500) ~ 1e299), so the ratio is taken as the paper's product
C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k/i), whose factors lie in [0, 1).
"""

from __future__ import annotations

import torch
from torch import Tensor


def pass_at_k(
    num_correct: Tensor,  # [B] integer (or integral float), correct samples per problem
    n: int,  # samples per problem
    k: int,
) -> Tensor:  # [B] float64
    """Unbiased pass@k per problem, vectorised over problems; raises if k > n."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n (samples per problem) must be a positive int, got {n!r}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
        raise ValueError(f"k must be an int with 1 <= k <= n = {n}, got {k!r}; draw at least k samples")
    if num_correct.dim() != 1:
        raise ValueError(f"num_correct must be 1-D [B], got shape {tuple(num_correct.shape)}")
    if num_correct.is_floating_point():
        if not bool((num_correct == num_correct.round()).all()):
            raise ValueError("num_correct must hold whole numbers of correct samples")
    elif num_correct.dtype == torch.bool or num_correct.is_complex():
        raise TypeError(f"num_correct must be an integer tensor, got {num_correct.dtype}")
    c = num_correct.long()
    if bool(((c < 0) | (c > n)).any()):
        raise ValueError(f"num_correct must lie in [0, n = {n}], got min {int(c.min())}, max {int(c.max())}")

    # suffix[c] = prod of the c largest-i factors, i = n, n-1, ..., n-c+1; suffix[0] = 1 (no correct
    # sample: pass@k = 0). Once c > n - k the product reaches the factor i = k, which is 0, so pass@k is
    # exactly 1 (every k-subset contains a correct sample).
    i = torch.arange(n, 0, -1, dtype=torch.float64, device=c.device)
    one = torch.ones(1, dtype=torch.float64, device=c.device)
    suffix = torch.cat([one, torch.cumprod(1.0 - k / i, dim=0)])
    return 1.0 - suffix[c]
