"""Token sampling and the log-probs recorded with it (pure functions, batched over rows with per-row settings).

Reproducibility: every sampled row draws its randomness from its own seed (from the request seed and the sample
index), so what a sequence samples does not depend on which other sequences share its batch, nor on preemption.
On CUDA one kernel samples the whole batch (`kernels.sample`: Philox noise keyed by the seed and the step); on
the CPU each row's `torch.Generator` draws V exponentials per step (the generator survives a recompute). The
two devices therefore draw different (equally distributed) samples for the same seed.

Log-probs are those of the *untempered* fp32 distribution, computed by the trainer's own function
(`models.logprobs.logprobs_from_hidden`): temperature, top-k and top-p shape only the sampling distribution.
The trainer's importance ratios compare against exactly this quantity. One exception, for speed: a CUDA-graphed
decode step in fast mode takes the log-prob from the sampling kernel's own pass over the logits
(`kernels.sample(..., logprobs=True)`), the same quantity with its fp32 sums in another order (a rounding
difference, as between torch's reductions at two batch shapes). Batch-invariant mode always uses the trainer's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..models.logprobs import logprobs_from_hidden
from ..triton_kernels import kernels_module, kernels_run_on

_MASK64 = (1 << 64) - 1


def sample_seed(seed: int, index: int) -> int:
    """A well-mixed 63-bit generator seed for sample `index` of a request seeded `seed` (SplitMix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


@dataclass
class RowSampling:
    """Per-row sampling settings of a batch, kept on the host so that choosing code paths needs no device sync."""

    temperature: Tensor  # [B] fp32, 0 = greedy
    top_k: Tensor  # [B] int64, 0 = off
    top_p: Tensor  # [B] fp32, 1 = off
    generators: list[torch.Generator | None]  # per row; None only for greedy rows
    steps: list[int]  # per row: tokens it generated so far (keys the CUDA kernel's noise)

    @property
    def masked(self) -> bool:
        """Does some sampled row need top-k / top-p masking (a sort, chosen on the host)?"""
        return bool(((self.temperature > 0) & ((self.top_k > 0) | (self.top_p < 1))).any())

    @property
    def seeds(self) -> list[int]:
        return generator_seeds(self.generators)

    def sample(self, logits: Tensor) -> Tensor:
        """-> [B] int64 tokens drawn from `logits` [B, V] fp32 with these settings."""
        return sample_tokens(logits, self.temperature, self.top_k, self.top_p, self.generators, self.steps)

    def advanced(self) -> RowSampling:
        """The settings of the next step: one more token generated per row (generators advance themselves)."""
        return RowSampling(self.temperature, self.top_k, self.top_p, self.generators, [s + 1 for s in self.steps])


def mask_top_k_top_p(
    logits: Tensor,  # [B, V] fp32, already divided by the temperature
    top_k: Tensor,  # [B] int64, 0 = off
    top_p: Tensor,  # [B] fp32 in (0, 1], 1 = off
) -> Tensor:
    """-> [B, V] with tokens outside each row's top-k, then outside its top-p nucleus, set to -inf.

    Top-p is applied to the distribution renormalised after top-k (vLLM's order). The nucleus is the smallest
    prefix of the sorted tokens whose mass reaches p; the most likely token is always kept.
    """
    v = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(v, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, v)[:, None]
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def sample_tokens(
    logits: Tensor,  # [B, V] fp32 untempered
    temperature: Tensor,  # [B] fp32, 0 = greedy
    top_k: Tensor,  # [B] int64, 0 = off
    top_p: Tensor,  # [B] fp32
    generators: list[torch.Generator | None],  # per row; None only for greedy rows
    steps: list[int] | None = None,  # per row: tokens it generated so far (keys the CUDA kernel's noise)
) -> Tensor:
    """-> [B] int64. Greedy rows take the argmax; the others draw by the exponential race
    argmax(p / E), E ~ Exp(1) i.i.d., which samples exactly from p.

    The per-row settings may live on the host (the engine keeps them there): choosing rows then needs no sync
    with the device."""
    dev = logits.device
    if steps is not None and sampling_kernel(logits.device) is not None:
        return _sample_on_device(logits, temperature, top_k, top_p, generators, steps)
    tokens = logits.argmax(dim=-1)
    rows = (temperature > 0).nonzero().flatten()
    if rows.numel() == 0:
        return tokens
    idx = rows.to(dev)
    scaled = logits[idx] / temperature[rows].to(dev)[:, None]
    k, p = top_k[rows], top_p[rows]
    if bool((k > 0).any()) or bool((p < 1).any()):
        scaled = mask_top_k_top_p(scaled, k.to(dev), p.to(dev))
    probs = scaled.softmax(dim=-1)
    noise = torch.empty_like(probs)
    for i, row in enumerate(rows.tolist()):
        gen = generators[row]
        if gen is None:
            raise ValueError(f"row {row} samples (temperature > 0) but has no generator")
        noise[i].exponential_(generator=gen)
    tokens[idx] = (probs / noise).argmax(dim=-1)
    return tokens


def generator_seeds(generators: list[torch.Generator | None]) -> list[int]:
    """The sampling kernel's per-row seeds: each generator's own seed (greedy rows: 0, unused)."""
    return [g.initial_seed() if g is not None else 0 for g in generators]


def sampling_kernel(device: torch.device):
    """The one-launch sampler (`kernels.sample`) on a CUDA device it runs on, else None."""
    return kernels_module().sample if device.type == "cuda" and kernels_run_on(device) else None


def _sample_on_device(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor,
                      generators: list[torch.Generator | None], steps: list[int]) -> Tensor:
    """One kernel for the batch; rows with top-k / top-p are tempered and masked first (temperature 1 after)."""
    dev = logits.device
    temp = temperature.clone()
    masked = ((temperature > 0) & ((top_k > 0) | (top_p < 1))).nonzero().flatten()
    if masked.numel():
        idx = masked.to(dev)
        logits = logits.clone()
        logits[idx] = mask_top_k_top_p(logits[idx] / temperature[masked].to(dev)[:, None], top_k[masked].to(dev),
                                       top_p[masked].to(dev))
        temp[masked] = 1.0
    ints = torch.tensor([generator_seeds(generators), steps], dtype=torch.long).to(dev, non_blocking=True)
    return sampling_kernel(logits.device)(logits, temp.to(dev, non_blocking=True), ints[0], ints[1])


def sampled_logprobs(
    logits: Tensor,  # [B, V] fp32 untempered, the logits the tokens were sampled from
    tokens: Tensor,  # [B] int64
) -> Tensor:
    """-> [B] fp32 log p(token). The logits are fed to the trainer's `logprobs_from_hidden` as hidden states
    with an identity head, so the arithmetic (fp32 logsumexp, gather) is the trainer's, not a re-derivation."""
    lp, _ = logprobs_from_hidden(logits[:, None, :], nn.Identity(), tokens[:, None])
    return lp[:, 0]
