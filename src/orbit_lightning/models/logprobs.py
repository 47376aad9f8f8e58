"""Per-token log-probs of given targets without a full-vocab fp32 log-softmax for the whole batch at once.

With a 150k vocabulary, [B, T, V] fp32 logits are the largest tensor of an RL step. Rows are processed in
chunks; under autograd each chunk is recomputed in backward (checkpointed), so only hidden states are saved.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from . import invariant


def _chunk_logprobs(h: Tensor, lm_head: nn.Module, targets: Tensor, with_entropy: bool) -> tuple[Tensor, Tensor]:
    logits = lm_head(h).float()  # [n, V] fp32: the trainer and the engine both score in fp32
    lse = invariant.logsumexp(logits)
    lp = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return lp, lp.new_zeros(0)
    p = (logits - lse[:, None]).exp()
    return lp, lse - (p * logits).sum(-1)


def _chunk_logprobs_in_mode(h: Tensor, lm_head: nn.Module, targets: Tensor, with_entropy: bool,
                            invariant_on: bool) -> tuple[Tensor, Tensor]:
    # The recomputation in backward runs outside the caller's batch-invariant mode (autograd does not carry
    # it), so the chunk re-enters it: recomputed tensors must match the forward's.
    with invariant.invariant_mode(invariant_on):
        return _chunk_logprobs(h, lm_head, targets, with_entropy)


def logprobs_from_hidden(
    hidden: Tensor,  # [B, T, D] final normed hidden states
    lm_head: nn.Module,
    targets: Tensor,  # [B, T] int64 token whose log-prob is wanted at each position
    chunk_rows: int = 1024,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """-> (logprobs [B, T] float32, entropy [B, T] float32 or None)."""
    b, t, d = hidden.shape
    h, y = hidden.reshape(-1, d), targets.reshape(-1)
    lps, ents = [], []
    for s in range(0, h.shape[0], chunk_rows):
        hc, yc = h[s : s + chunk_rows], y[s : s + chunk_rows]
        if torch.is_grad_enabled() and hc.requires_grad:
            lp, ent = checkpoint(_chunk_logprobs_in_mode, hc, lm_head, yc, with_entropy, invariant.active(),
                                 use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(hc, lm_head, yc, with_entropy)
        lps.append(lp)
        ents.append(ent)
    lp = torch.cat(lps).view(b, t)
    return lp, torch.cat(ents).view(b, t) if with_entropy else None


def token_logprobs(
    model: nn.Module,
    input_ids: Tensor,  # [B, T]
    attention_mask: Tensor | None = None,  # [B, T]
    start: int = 0,
    chunk_rows: int = 1024,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """log p(input_ids[:, i+1] | input_ids[:, :i+1]) for i in [start, T-1) -> [B, T-1-start] float32.

    `start` skips prompt positions whose log-probs are not needed (saves the lm_head matmul on them).
    """
    hidden = model.hidden_states(input_ids, attention_mask)[:, start:-1]
    return logprobs_from_hidden(hidden, model.lm_head, input_ids[:, start + 1 :], chunk_rows, with_entropy)
