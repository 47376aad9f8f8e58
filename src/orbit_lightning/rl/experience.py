"""The data of one RL step, typed. N = prompts × samples per prompt, rows grouped per prompt (G contiguous).

Sequences are laid out as [left-padded prompt | right-padded completion], so every completion starts at the
same column `prompt_len` and the trainer scores all of them in one forward. Per-token tensors over
completions are [N, C] with C = the longest completion; column j is completion token j.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor


@dataclass
class Trajectory:
    """What rollout + rewards produce (step 2–3 of an RL step)."""

    input_ids: Tensor  # [N, P + C] int64: left-padded prompt, then the completion, right-padded with pad_id
    attention_mask: Tensor  # [N, P + C] int64: 1 on real prompt and completion tokens
    completion_mask: Tensor  # [N, C] float32: 1 on generated tokens (incl. a final EOS), 0 on padding
    rollout_logprobs: Tensor  # [N, C] float32: the engine's log-prob of each generated token
    rewards: Tensor  # [N] float32: 0 where the reward is missing
    reward_valid: Tensor  # [N] bool: False when a reward function failed; such samples are masked out
    adapter_versions: Tensor  # [N] int64: the adapter version that generated each sample
    prompt_len: int  # P: column where completions start
    group_size: int  # G

    @property
    def num_samples(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device) -> Trajectory:
        return type(self)(**{f.name: _move(getattr(self, f.name), device) for f in fields(self)})


@dataclass
class Experience(Trajectory):
    """Trajectory plus what the trainer adds before updating (steps 4–5)."""

    advantages: Tensor | None = None  # [N] float32 sequence-level advantages
    old_logprobs: Tensor | None = None  # [N, C] float32 trainer log-probs before any update (no_grad)
    ref_logprobs: Tensor | None = None  # [N, C] float32 adapter-disabled log-probs; None when kl_coef == 0
    loss_mask: Tensor | None = None  # [N, C] float32: completion_mask with failed-reward samples zeroed

    def select(self, rows: Tensor) -> Experience:
        """A minibatch: the rows `rows` [n] int64 of every per-sample tensor."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = v[rows] if isinstance(v, Tensor) else v
        return type(self)(**out)


@dataclass
class Samples:
    """Generated samples before packing: G contiguous per prompt, plus their rewards (step 2–3 raw form)."""

    prompt_ids: list[list[int]]  # N prompts (each repeated G times)
    completion_ids: list[list[int]]  # N completions
    logprobs: list[list[float]]  # N engine log-probs, one per completion token
    prompts: list[str]  # N prompt texts
    completions: list[str]  # N decoded completions
    versions: list[int]  # N adapter versions (-1: no adapter)
    rewards: Tensor  # [N] float32
    valid: Tensor  # [N] bool
    per_function: dict[str, Tensor]  # name -> [N] float32, NaN where missing

    def select_groups(self, keep: Tensor, group_size: int) -> Samples:
        """Only the groups (of `group_size` rows) where keep [B] is True."""
        rows = [i for i, k in enumerate(keep.repeat_interleave(group_size).tolist()) if k]
        idx = torch.tensor(rows, dtype=torch.long)
        pick = lambda xs: [xs[i] for i in rows]  # noqa: E731
        return Samples(pick(self.prompt_ids), pick(self.completion_ids), pick(self.logprobs), pick(self.prompts),
                       pick(self.completions), pick(self.versions), self.rewards[idx], self.valid[idx],
                       {k: v[idx] for k, v in self.per_function.items()})

    @staticmethod
    def concat(parts: list[Samples]) -> Samples:
        cat = lambda name: [x for p in parts for x in getattr(p, name)]  # noqa: E731
        keys = parts[0].per_function
        return Samples(cat("prompt_ids"), cat("completion_ids"), cat("logprobs"), cat("prompts"), cat("completions"),
                       cat("versions"), torch.cat([p.rewards for p in parts]), torch.cat([p.valid for p in parts]),
                       {k: torch.cat([p.per_function[k] for p in parts]) for k in keys})

    def to_experience(self, group_size: int, pad_id: int) -> Experience:
        ids, attn, cmask, rlp, p = pack_sequences(self.prompt_ids, self.completion_ids, self.logprobs, pad_id)
        valid = self.valid.bool()
        return Experience(input_ids=ids, attention_mask=attn, completion_mask=cmask, rollout_logprobs=rlp,
                          rewards=self.rewards.float(), reward_valid=valid,
                          adapter_versions=torch.tensor(self.versions, dtype=torch.long), prompt_len=p,
                          group_size=group_size, loss_mask=cmask * valid[:, None].float())


def _move(v, device):
    return v.to(device) if isinstance(v, Tensor) else v


def pack_sequences(
    prompts: list[list[int]],  # N prompt token lists (already repeated G times)
    completions: list[list[int]],  # N completion token lists
    logprobs: list[list[float]],  # N per-token engine log-probs, same lengths as completions
    pad_id: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
    """-> input_ids [N, P+C], attention_mask [N, P+C], completion_mask [N, C], rollout_logprobs [N, C], P."""
    n = len(prompts)
    p = max(len(x) for x in prompts)
    c = max(1, max(len(x) for x in completions))
    ids = torch.full((n, p + c), pad_id, dtype=torch.long)
    attn = torch.zeros(n, p + c, dtype=torch.long)
    cmask = torch.zeros(n, c)
    lps = torch.zeros(n, c)
    for i, (pr, co, lp) in enumerate(zip(prompts, completions, logprobs, strict=True)):
        ids[i, p - len(pr) : p] = torch.tensor(pr)
        attn[i, p - len(pr) : p + len(co)] = 1
        if co:
            ids[i, p : p + len(co)] = torch.tensor(co)
            cmask[i, : len(co)] = 1
            lps[i, : len(co)] = torch.tensor(lp, dtype=torch.float32)
    return ids, attn, cmask, lps, p
