"""KL estimators against the reference policy, KL-as-reward-penalty, and token entropy from logits.

The KL estimators follow Schulman's note "Approximating KL Divergence" (2020). For tokens sampled from
pi, with log-ratio x = log pi_ref(y) - log pi(y), each is an estimate of KL(pi || pi_ref):

- k1 = -x                 unbiased, high variance, can be negative
- k2 = x**2 / 2           biased, low variance, >= 0; as a loss its grad is the reverse-KL grad on-policy
- k3 = exp(x) - 1 - x     unbiased, low variance, >= 0 ("low_var_kl" in veRL)
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ._common import check_token_tensor, compute_dtype, float_mask, masked_sum

KL_KINDS = ("k1", "k2", "k3")

# k3 exponentiates x. Where the reference is far likelier than the policy (x >> 0), exp(x) overflows
# float32 past x ~ 88 and its grad is as large as its value, so one off-policy token could dominate the
# whole batch's loss. Clamping x to +-20 bounds a token's k3 by ~5e8 while leaving every ordinary token
# (|x| is O(1)) untouched; the clamp also zeroes the grad of the few tokens beyond it.
DEFAULT_K3_MAX_LOG_RATIO = 20.0


def kl_estimate(
    logprobs: Tensor,  # [N, T] float32, policy (may carry grad)
    ref_logprobs: Tensor,  # [N, T] float32, reference policy
    kind: str = "k3",
    max_log_ratio: float = DEFAULT_K3_MAX_LOG_RATIO,
) -> Tensor:  # [N, T], per-token estimate of KL(pi || pi_ref)
    """Per-token KL estimate of the given ``kind`` (k1, k2, k3); ``max_log_ratio`` applies to k3 only."""
    check_token_tensor(ref_logprobs, "ref_logprobs", logprobs.shape)
    dtype = compute_dtype(logprobs, "logprobs")
    x = ref_logprobs.detach().to(dtype) - logprobs.to(dtype)
    if kind == "k1":
        return -x
    if kind == "k2":
        return 0.5 * x.square()
    if kind == "k3":
        x = x.clamp(-max_log_ratio, max_log_ratio)
        # expm1 keeps k3's small values (|x| << 1, where k3 ~ x^2/2) free of 1 - 1 cancellation.
        return torch.expm1(x) - x
    raise ValueError(f"unknown KL estimator {kind!r}; choose one of {KL_KINDS}")


def kl_penalized_rewards(
    rewards: Tensor,  # [N] float32
    logprobs: Tensor,  # [N, T] float32, the policy that sampled (rollout/old)
    ref_logprobs: Tensor,  # [N, T] float32
    mask: Tensor,  # [N, T] bool/float
    beta: float,
    kind: str = "k1",
) -> Tensor:  # [N] float32, detached
    """KL as a reward penalty: r_i - beta * sum_t KL_t over the counted tokens (e.g. REINFORCE++, PPO-RLHF).

    The penalty is part of the reward, so no gradient flows through it.
    """
    if rewards.dim() != 1 or rewards.shape[0] != logprobs.shape[0]:
        raise ValueError(f"rewards must be [N], N = {logprobs.shape[0]}, got shape {tuple(rewards.shape)}")
    if beta < 0:
        raise ValueError(f"beta must be >= 0 (it is a penalty weight), got {beta}")
    with torch.no_grad():
        kl = kl_estimate(logprobs, ref_logprobs, kind)
        seq_kl = masked_sum(kl, float_mask(mask, kl.shape, kl.dtype), dim=-1)
        return (rewards.to(kl.dtype) - beta * seq_kl).float()


def entropy_from_logits(logits: Tensor) -> Tensor:  # [...] float32 (float64 for float64 input)
    """Entropy of softmax(logits) over the last dim, H = -sum_v p_v log p_v, for logits [..., V].

    log p comes from log_softmax (z - logsumexp(z)), never log(softmax(z)), so tiny p cannot underflow into
    log(0). Summing p * log p avoids the cancellation of the equivalent logsumexp(z) - sum p z when logits are
    large. -inf logits (filtered vocab) have p = 0 and contribute 0; their log p is clamped to a finite
    value so that 0 * -inf does not make NaN.
    """
    if not logits.is_floating_point() or logits.dim() < 1:
        raise TypeError(f"logits must be a float tensor [..., V], got {logits.dtype} {tuple(logits.shape)}")
    logp = torch.log_softmax(logits.to(compute_dtype(logits, "logits")), dim=-1)
    return -(logp.exp() * logp.clamp_min(torch.finfo(logp.dtype).min)).sum(dim=-1)


def entropy_from_logits_chunked(
    logits: Tensor,  # [..., V], any float dtype (bf16 logits stay bf16 outside each chunk)
    chunk: int = 1024,
) -> Tensor:  # [...] float32
    """``entropy_from_logits`` that upcasts at most ``chunk`` rows of [..., V] at a time.

    With grad enabled each chunk is checkpointed: backward recomputes the chunk's softmax instead of
    keeping every chunk's float32 probabilities alive, so the peak stays at one chunk in both directions.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 rows, got {chunk}")
    if not logits.is_floating_point() or logits.dim() < 1:
        raise TypeError(f"logits must be a float tensor [..., V], got {logits.dtype} {tuple(logits.shape)}")
    rows = logits.reshape(-1, logits.shape[-1])
    track_grad = torch.is_grad_enabled() and logits.requires_grad
    parts = []
    for piece in rows.split(chunk, dim=0):
        if track_grad:
            parts.append(checkpoint(entropy_from_logits, piece, use_reentrant=False))
        else:
            parts.append(entropy_from_logits(piece))
    return torch.cat(parts).reshape(logits.shape[:-1])
