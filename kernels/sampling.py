"""One-launch token sampling for a batch of rows, each with its own temperature and seed.

The exponential race argmax_v p_v / E_v with E_v ~ Exp(1) draws exactly from p; in logits,
argmax_v (logit_v / T - log E_v) (the normalizer of p shifts every score alike). The noise is Philox
(`tl.rand`) keyed by the row's seed mixed with its step, and counted by vocabulary index, so a sequence's
draws depend only on (seed, step): not on its batch, its row, or a preemption in between, and no per-row
generator launch is needed. Temperature 0 takes the plain argmax. Ties go to the lowest index, as in
torch.argmax. Rows that need top-k / top-p are masked (-inf) by the caller first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_BLOCK = 1024
_GOLDEN = tl.constexpr(-7046029254386353131)  # 0x9E3779B97F4A7C15 as int64: spreads steps over the key space


@triton.jit
def _sample_kernel(logits_ptr, stride, V, temp_ptr, seed_ptr, step_ptr, out_ptr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    temp = tl.load(temp_ptr + row)
    key = tl.load(seed_ptr + row) ^ (tl.load(step_ptr + row) * _GOLDEN)
    greedy = temp <= 0.0
    inv_t = tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, temp))
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_idx = tl.full((BLOCK,), 2147483647, tl.int32)
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        ok = cols < V
        x = tl.load(logits_ptr + row * stride + cols, mask=ok, other=float("-inf")).to(tl.float32)
        u = tl.rand(key, cols)  # [0, 1): u = 0 gives E = inf, a score of -inf, never chosen
        noise = tl.where(greedy, 0.0, tl.log(-tl.log(u)))
        score = tl.where(ok, x * inv_t - noise, float("-inf"))
        take = score > best  # strict: the earlier (lower) index keeps a tie within a lane
        best = tl.where(take, score, best)
        best_idx = tl.where(take, cols, best_idx)
    top = tl.max(best, axis=0)
    # Lowest index among the lanes holding the maximum; a row of all -inf falls back to index 0.
    winner = tl.min(tl.where(best == top, best_idx, 2147483647), axis=0)
    tl.store(out_ptr + row, tl.where(winner == 2147483647, 0, winner).to(tl.int64))


def sample(logits: Tensor, temperature: Tensor, seeds: Tensor, steps: Tensor) -> Tensor:
    """logits [B, V] (any float dtype, untempered, -inf for masked tokens); temperature [B] float (0 =
    greedy); seeds [B] int64; steps [B] int64 (the row's draw number). -> tokens [B] int64."""
    b, v = logits.shape
    dev = logits.device
    for name, t in (("temperature", temperature), ("seeds", seeds), ("steps", steps)):
        if t.shape != (b,) or t.device != dev:
            raise ValueError(f"{name} must be a [{b}] tensor on {dev}, got {tuple(t.shape)} on {t.device}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.empty(b, dtype=torch.int64, device=dev)
    if b:
        _sample_kernel[(b,)](logits, logits.stride(0), v, temperature.float(), seeds.long(), steps.long(), out,
                             BLOCK=min(_BLOCK, triton.next_power_of_2(v)), num_warps=4)
    return out
