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

from .pdl import use_pdl, wait_for_producers

_CHUNK = 2048  # vocabulary entries per program: a 152k vocabulary spreads over ~75 programs per row
_GOLDEN = tl.constexpr(-7046029254386353131)  # 0x9E3779B97F4A7C15 as int64: spreads steps over the key space


@triton.jit
def _sample_kernel(logits_ptr, stride, V, temp_ptr, seed_ptr, step_ptr, best_ptr, idx_ptr, n_chunks,
                   CHUNK: tl.constexpr, PDL: tl.constexpr):
    """The best (score, index) of one row's vocabulary chunk; ties keep the lowest index."""
    wait_for_producers(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temp = tl.load(temp_ptr + row)
    key = tl.load(seed_ptr + row) ^ (tl.load(step_ptr + row) * _GOLDEN)
    greedy = temp <= 0.0
    inv_t = tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, temp))
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = cols < V
    x = tl.load(logits_ptr + row * stride + cols, mask=ok, other=float("-inf")).to(tl.float32)
    u = tl.rand(key, cols)  # [0, 1): u = 0 gives E = inf, a score of -inf, never chosen
    noise = tl.where(greedy, 0.0, tl.log(-tl.log(u)))
    score = tl.where(ok, x * inv_t - noise, float("-inf"))
    top = tl.max(score, axis=0)
    first = tl.min(tl.where(score == top, cols, 2147483647), axis=0)
    tl.store(best_ptr + row * n_chunks + chunk, top)
    tl.store(idx_ptr + row * n_chunks + chunk, first)


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
    if b == 0:
        return torch.empty(0, dtype=torch.int64, device=dev)
    chunk = min(_CHUNK, triton.next_power_of_2(v))
    n_chunks = triton.cdiv(v, chunk)
    best = torch.empty((b, n_chunks), dtype=torch.float32, device=dev)
    idx = torch.empty((b, n_chunks), dtype=torch.int32, device=dev)
    pdl = use_pdl(logits.device)
    _sample_kernel[(b, n_chunks)](logits, logits.stride(0), v, temperature.float(), seeds.long(), steps.long(), best,
                                  idx, n_chunks, CHUNK=chunk, PDL=pdl, launch_pdl=pdl, num_warps=4)
    # Chunks are in index order and argmax keeps the first maximum, so ties still go to the lowest index. A row
    # of all -inf picks chunk 0's first entry, index 0.
    won = best.argmax(dim=-1, keepdim=True)
    return idx.gather(1, won)[:, 0].long()
