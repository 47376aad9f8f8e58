"""Clipped policy-gradient losses behind a name -> function registry, and loss aggregation.

Every policy loss has the signature::

    fn(logprobs: Tensor,       # [N, T] float32, current policy (carries the grad)
       old_logprobs: Tensor,   # [N, T] float32, policy that the samples are scored against (no grad)
       advantages: Tensor,     # [N] (sequence) or [N, T] (token) float32
       mask: Tensor,           # [N, T] bool/float, 1 = counted completion token
       **options) -> tuple[Tensor, dict[str, Tensor]]   # per-token loss [N, T], metrics (0-dim, detached)

The per-token loss is to be minimised and is reduced with ``aggregate_loss``. Metrics are fractions and
statistics over the counted tokens: clip_frac_low, clip_frac_high, dual_clip_frac, ratio_mean, ratio_max.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..registry import Registry
from ._common import check_token_tensor, compute_dtype, float_mask, masked_mean, masked_sum, safe_denominator

PolicyLossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")
AGGREGATION_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")

# exp() of a float32 log-ratio overflows past ~88 and the loss/grad turn inf/NaN. A ratio of e^20 ≈ 5e8 is
# already far outside any trust region, so clamping the log-ratio there changes nothing that matters.
DEFAULT_MAX_LOG_RATIO = 20.0


register_policy_loss = POLICY_LOSSES.register  # decorator; losses follow the module's common signature
get_policy_loss = POLICY_LOSSES.lookup


def _prepare(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Validate; return logprobs, old_logprobs [N,T], advantages [N,1] or [N,T], mask, all in one dtype."""
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [N, T], got shape {tuple(logprobs.shape)}")
    dtype = compute_dtype(logprobs, "logprobs")
    check_token_tensor(old_logprobs, "old_logprobs", logprobs.shape)
    if advantages.shape == logprobs.shape[:1]:
        advantages = advantages[:, None]
    elif advantages.shape != logprobs.shape:
        raise ValueError(
            f"advantages must be [N] or [N, T] = {tuple(logprobs.shape)}, got {tuple(advantages.shape)}"
        )
    m = float_mask(mask, logprobs.shape, dtype)
    # Zero the log-probs off the mask: padding may hold -inf, and -inf - -inf = NaN there would reach the
    # grads through exp's backward (0 * NaN) even though the aggregation never selects those tokens.
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)
    lp = torch.where(m > 0, logprobs.to(dtype), zero)
    old = torch.where(m > 0, old_logprobs.detach().to(dtype), zero)
    return lp, old, advantages.detach().to(dtype), m


def _check_clip(eps_low: float, eps_high: float, dual_clip: float | None) -> None:
    if not 0.0 <= eps_low < 1.0:
        raise ValueError(f"eps_low must be in [0, 1) so that 1 - eps_low > 0, got {eps_low}")
    if eps_high < 0.0:
        raise ValueError(f"eps_high must be >= 0, got {eps_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (a cap on the ratio when A < 0), got {dual_clip}")


def _clipped_surrogate(
    ratio: Tensor,  # [N, T], carries the grad
    adv: Tensor,  # [N, 1] or [N, T]
    mask: Tensor,  # [N, T] float
    eps_low: float,
    eps_high: float,
    dual_clip: float | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's pessimistic clipped objective, negated: max(-A r, -A clip(r, 1-eps_low, 1+eps_high))."""
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high))
    if dual_clip is not None:
        # For A < 0 the clip above bounds r only from below, so -A*r grows without limit as r does; the
        # dual clip (Ye et al. 2020) caps that loss at -c*A, i.e. ignores the grad once r > c.
        loss = torch.where(adv < 0, torch.minimum(loss, -dual_clip * adv), loss)
    with torch.no_grad():
        counts = mask > 0
        neg, pos = adv < 0, adv > 0
        # These are exactly the tokens whose gradient the clip zeroes.
        low = neg & (ratio < 1.0 - eps_low)
        high = pos & (ratio > 1.0 + eps_high)
        dual = neg & (ratio > dual_clip) if dual_clip is not None else torch.zeros_like(counts)
        metrics = {
            "clip_frac_low": masked_mean(low.to(mask.dtype), mask),
            "clip_frac_high": masked_mean(high.to(mask.dtype), mask),
            "dual_clip_frac": masked_mean(dual.to(mask.dtype), mask),
            "ratio_mean": masked_mean(ratio, mask),
            # ratio > 0, so 0 stands for "no counted token"
            "ratio_max": torch.where(counts, ratio, torch.zeros_like(ratio)).max(),
        }
    return loss, metrics


@register_policy_loss("ppo")
def ppo_loss(
    logprobs: Tensor,  # [N, T] float32
    old_logprobs: Tensor,  # [N, T] float32
    advantages: Tensor,  # [N] or [N, T] float32
    mask: Tensor,  # [N, T] bool/float
    *,
    eps_low: float = 0.2,
    eps_high: float | None = None,
    dual_clip: float | None = None,
    max_log_ratio: float = DEFAULT_MAX_LOG_RATIO,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Token-level PPO clip (Schulman et al. 2017) with token ratio r_t = pi(y_t) / pi_old(y_t).

    ``eps_high`` defaults to ``eps_low``; a larger one is DAPO's clip-higher (Yu et al. 2025, e.g. 0.2/0.28).
    ``dual_clip`` is the constant c > 1 of dual-clip PPO for negative advantages.
    """
    eps_high = eps_low if eps_high is None else eps_high
    _check_clip(eps_low, eps_high, dual_clip)
    lp, old, adv, m = _prepare(logprobs, old_logprobs, advantages, mask)
    ratio = torch.exp((lp - old).clamp(-max_log_ratio, max_log_ratio))
    return _clipped_surrogate(ratio, adv, m, eps_low, eps_high, dual_clip)


@register_policy_loss("gspo")
def gspo_loss(
    logprobs: Tensor,  # [N, T] float32
    old_logprobs: Tensor,  # [N, T] float32
    advantages: Tensor,  # [N] or [N, T] float32
    mask: Tensor,  # [N, T] bool/float
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    dual_clip: float | None = None,
    max_log_ratio: float = DEFAULT_MAX_LOG_RATIO,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025): clip the length-normalised sequence ratio
    s_i = (pi(y_i) / pi_old(y_i)) ** (1 / |y_i|) = exp(mean_t log r_t) instead of token ratios.

    Written in the paper's GSPO-token form s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)]: every token's value
    is s_i and its grad is s_i * grad log pi(y_t). With sequence advantages and the ``seq_mean_token_mean``
    aggregation this is exactly the sequence-level GSPO objective (grad s_i = s_i * mean_t grad log pi).
    Defaults are the paper's clip range (3e-4, 4e-4); the metrics count tokens, so they are length-weighted.
    """
    _check_clip(eps_low, eps_high, dual_clip)
    lp, old, adv, m = _prepare(logprobs, old_logprobs, advantages, mask)
    length = m.sum(dim=-1, keepdim=True)  # [N, 1]
    seq_log_ratio = masked_sum(lp.detach() - old, m, dim=-1, keepdim=True) / safe_denominator(length)
    seq_log_ratio = seq_log_ratio.clamp(-max_log_ratio, max_log_ratio)
    ratio = torch.exp(seq_log_ratio + lp - lp.detach())  # [N, T], value s_i on every token
    return _clipped_surrogate(ratio, adv, m, eps_low, eps_high, dual_clip)


def aggregate_loss(
    loss_tok: Tensor,  # [N, T] float
    mask: Tensor,  # [N, T] bool/float
    mode: str = "token_mean",
    max_tokens: int | None = None,
    denominator: float | Tensor | None = None,
) -> Tensor:  # [] scalar
    """Reduce a per-token loss to a scalar.

    - ``token_mean``: sum over counted tokens / number of counted tokens (DAPO's token-level loss).
    - ``seq_mean_token_mean``: per-sequence token mean, then mean over non-empty sequences (GRPO paper).
    - ``seq_mean_token_sum_norm``: per-sequence token sum / ``max_tokens`` (a constant: the generation length
      limit), then mean over non-empty sequences (Dr. GRPO; no length bias).

    ``denominator`` replaces the count (tokens for ``token_mean``, non-empty sequences otherwise). When a
    minibatch is split into micro-batches, pass the whole minibatch's count so that accumulated gradients
    equal the unsplit ones. An all-zero mask gives 0 that still has a grad path to ``loss_tok``.
    """
    if loss_tok.dim() != 2:
        raise ValueError(f"loss_tok must be [N, T], got shape {tuple(loss_tok.shape)}")
    m = float_mask(mask, loss_tok.shape, compute_dtype(loss_tok, "loss_tok"))
    if mode == "token_mean":
        total, count = masked_sum(loss_tok, m), m.sum()
    elif mode in ("seq_mean_token_mean", "seq_mean_token_sum_norm"):
        length = m.sum(dim=-1)  # [N]
        if mode == "seq_mean_token_mean":
            per_seq = masked_sum(loss_tok, m, dim=-1) / safe_denominator(length)
        else:
            if max_tokens is None or max_tokens <= 0:
                raise ValueError(
                    "seq_mean_token_sum_norm needs max_tokens > 0: the fixed generation length limit "
                    f"(not the batch's padded length, which varies), got {max_tokens}"
                )
            per_seq = masked_sum(loss_tok, m, dim=-1) / max_tokens
        total, count = per_seq.sum(), (length > 0).to(m.dtype).sum()
    else:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; choose one of {AGGREGATION_MODES}")
    if denominator is not None:
        count = torch.as_tensor(denominator, dtype=m.dtype, device=m.device)
    return total / safe_denominator(count)
