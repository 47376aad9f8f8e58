"""The per-micro-batch RL objective: clipped policy loss (+ IS correction) + β·KL − entropy bonus."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..algorithms import aggregate_loss, get_policy_loss, importance_weights, kl_estimate
from ..algorithms.config import AlgoConfig
from ..models.logprobs import token_logprobs
from .experience import Experience


def score(model: nn.Module, exp: Experience, with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """Trainer log-probs of each completion token: [N, C] float32 (and entropy [N, C] if asked)."""
    p = exp.prompt_len
    lp, ent = token_logprobs(model, exp.input_ids, exp.attention_mask, start=p - 1, with_entropy=with_entropy)
    return lp, ent


def loss_denominator(mask: Tensor, mode: str) -> Tensor:
    """What `aggregate_loss` divides by over a whole minibatch, so micro-batch gradients sum to the full one."""
    return mask.sum() if mode == "token_mean" else (mask.sum(-1) > 0).sum()


def micro_batch_loss(
    model: nn.Module,
    mb: Experience,  # a micro-batch
    cfg: AlgoConfig,
    denominator: Tensor,  # loss_denominator over the enclosing minibatch
    max_tokens: int,
) -> tuple[Tensor, dict[str, Tensor]]:
    lp, ent = score(model, mb, with_entropy=cfg.entropy_coef > 0)
    mask = mb.loss_mask
    opts = dict(eps_low=cfg.eps_low, eps_high=cfg.eps_high, dual_clip=cfg.dual_clip)
    loss_tok, metrics = get_policy_loss(cfg.policy_loss)(lp, mb.old_logprobs, mb.advantages, mask, **opts)
    if cfg.importance is not None:
        w, mask, is_metrics = importance_weights(mb.old_logprobs, mb.rollout_logprobs, mask, method=cfg.importance,
                                                 level=cfg.importance_level, cap=cfg.importance_cap)
        loss_tok = loss_tok * w
        metrics.update(is_metrics)
    agg = dict(mode=cfg.loss_agg, max_tokens=max_tokens, denominator=denominator)
    loss = aggregate_loss(loss_tok, mask, **agg)
    metrics["loss/policy"] = loss.detach()
    if cfg.kl_coef > 0 and not cfg.kl_in_reward:
        kl = aggregate_loss(kl_estimate(lp, mb.ref_logprobs, cfg.kl_kind), mask, **agg)
        loss = loss + cfg.kl_coef * kl
        metrics["loss/kl"] = kl.detach()
    if ent is not None:
        entropy = aggregate_loss(ent, mask, **agg)
        loss = loss - cfg.entropy_coef * entropy
        metrics["entropy"] = entropy.detach()
    return loss, metrics


def micro_batches(rows: Tensor, exp: Experience, token_budget: int) -> list[Tensor]:
    """Split minibatch rows so each micro-batch holds at most `token_budget` padded tokens (at least one row)."""
    per_row = exp.input_ids.shape[1]
    size = max(1, token_budget // per_row)
    return list(rows.split(size))


@torch.no_grad()
def score_no_grad(model: nn.Module, exp: Experience, token_budget: int) -> Tensor:
    rows = torch.arange(exp.num_samples, device=exp.input_ids.device)
    return torch.cat([score(model, exp.select(r))[0] for r in micro_batches(rows, exp, token_budget)])
