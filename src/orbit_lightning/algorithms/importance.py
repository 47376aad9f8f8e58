"""Importance corrections for the train/rollout mismatch: truncated (TIS) and masked (MIS) IS weights.

Samples come from the rollout engine's policy mu, the loss is written for the trainer's pi_old; the two
differ wherever their numerics differ (precision, kernels, batch shapes). The ratio rho = pi_old / mu
reweights the loss back on-policy (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
Off-Policy RL Training"; Liu et al. 2025, "When Speed Kills Stability"):

- TIS: w = min(rho, cap); every token still counts.
- MIS: w = rho where lower <= rho <= cap, and tokens (or whole sequences) outside are dropped from the mask.

``level`` picks what rho is: "token" (per token), "sequence" (exp of the summed log-ratio over the
sequence's counted tokens: the exact sequence likelihood ratio) or "geometric" (exp of the mean log-ratio:
a length-normalised ratio that stays near 1 for long sequences).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._common import check_token_tensor, compute_dtype, float_mask, masked_mean, masked_sum, safe_denominator

IS_METHODS = ("tis", "mis")
IS_LEVELS = ("token", "sequence", "geometric")

# The log-ratio is clamped before exp() (a summed sequence log-ratio can reach hundreds and overflow);
# e^+-20 lies far outside any sensible [lower, cap], so the clamp never changes a kept weight.
_MAX_LOG_RATIO = 20.0


def importance_weights(
    old_logprobs: Tensor,  # [N, T] float32, trainer's pi_old
    rollout_logprobs: Tensor,  # [N, T] float32, rollout engine's mu for the same tokens
    mask: Tensor,  # [N, T] bool/float, 1 = counted completion token
    *,
    method: str = "tis",
    level: str = "token",
    cap: float = 2.0,
    lower: float | None = None,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """IS weights correcting rollout-policy samples to the trainer's policy.

    Returns (weights [N, T] detached, 0 off the mask; mask [N, T] bool, the input mask minus tokens MIS
    drops; metrics). ``lower`` is MIS's lower threshold (default: none, only rho > cap is masked).
    Multiply the per-token loss by the weights and aggregate it with the returned mask.
    """
    if method not in IS_METHODS:
        raise ValueError(f"unknown importance-sampling method {method!r}; choose one of {IS_METHODS}")
    if level not in IS_LEVELS:
        raise ValueError(f"unknown importance-sampling level {level!r}; choose one of {IS_LEVELS}")
    if not cap > 0:
        raise ValueError(f"cap must be > 0 (an upper bound on pi_old / mu, typically 2), got {cap}")
    if lower is not None and method != "mis":
        raise ValueError("lower applies to method='mis' only; TIS truncates from above")
    if lower is not None and not 0 <= lower < cap:
        raise ValueError(f"lower must satisfy 0 <= lower < cap = {cap}, got {lower}")
    if old_logprobs.dim() != 2:
        raise ValueError(f"old_logprobs must be [N, T], got shape {tuple(old_logprobs.shape)}")
    check_token_tensor(rollout_logprobs, "rollout_logprobs", old_logprobs.shape)
    dtype = compute_dtype(old_logprobs, "old_logprobs")

    with torch.no_grad():
        m = float_mask(mask, old_logprobs.shape, dtype)
        counts = m > 0
        # off-mask padding may be -inf on both sides; NaN weights there would poison grads (0 * NaN)
        log_ratio = torch.where(counts, old_logprobs.to(dtype) - rollout_logprobs.to(dtype), 0.0)  # [N, T]
        if level == "token":
            level_log_ratio = log_ratio
        else:
            level_log_ratio = masked_sum(log_ratio, m, dim=-1, keepdim=True)  # [N, 1]
            if level == "geometric":
                level_log_ratio = level_log_ratio / safe_denominator(m.sum(dim=-1, keepdim=True))
        rho = torch.exp(level_log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)).expand_as(log_ratio)

        if method == "tis":
            affected = rho > cap
            weights = rho.clamp(max=cap)
            keep = counts
        else:
            affected = rho > cap if lower is None else (rho > cap) | (rho < lower)
            weights = torch.where(affected, torch.zeros_like(rho), rho)
            keep = counts & ~affected
        weights = torch.where(counts, weights, 0.0)

        metrics = {
            "is_weight_mean": masked_mean(weights, m),
            "is_ratio_mean": masked_mean(rho, m),
            "is_ratio_max": torch.where(counts, rho, torch.zeros_like(rho)).max(),
            # truncated (TIS) or dropped (MIS) share of the counted tokens
            "is_capped_frac": masked_mean(affected.to(dtype), m),
            "logprob_abs_diff_mean": masked_mean(log_ratio.abs(), m),
        }
    return weights, keep, metrics
