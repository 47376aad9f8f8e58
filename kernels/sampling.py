"""One-launch token sampling for a batch of rows, each with its own temperature and seed.

The exponential race argmax_v p_v / E_v with E_v ~ Exp(1) draws exactly from p; in logits,
argmax_v (logit_v / T - log E_v) (the normalizer of p shifts every score alike). The noise is Philox
(`tl.rand`) keyed by the row's seed mixed with its step, and counted by vocabulary index, so a sequence's
draws depend only on (seed, step): not on its batch, its row, or a preemption in between, and no per-row
generator launch is needed. Temperature 0 takes the plain argmax. Ties go to the lowest index, as in
torch.argmax. Rows that need top-k / top-p are masked (-inf) by the caller first.

With `logprobs=True` the same pass also returns log p(token) of the *untempered* logits: each chunk program keeps
its share of the row's logsumexp (max, sum of exp), and the launch that picks the winning chunk folds them in
chunk order. At batch 1 this replaces ~12 launches of torch's logsumexp, gather and argmax (~35 us of a 1 ms
decode step, bench/trace_gaps.py); the sums run in another order than torch's, an fp32 rounding difference.
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
def _sample_kernel(logits_ptr, stride, V, temp_ptr, seed_ptr, step_ptr, best_ptr, idx_ptr, m_ptr, s_ptr, n_chunks,
                   CHUNK: tl.constexpr, LOGPROBS: tl.constexpr, PDL: tl.constexpr):
    """The best (score, index) of one row's vocabulary chunk, ties keeping the lowest index; with LOGPROBS also
    the chunk's max and sum of exp(logit - max) of the untempered logits."""
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
    if LOGPROBS:
        xs = tl.where(ok, x, float("-inf"))
        m = tl.max(xs, axis=0)
        safe = tl.where(m == float("-inf"), 0.0, m)  # an all -inf chunk: sum 0, not NaN
        tl.store(m_ptr + row * n_chunks + chunk, m)
        tl.store(s_ptr + row * n_chunks + chunk, tl.sum(tl.exp(xs - safe), axis=0))


@triton.jit
def _finish_kernel(logits_ptr, stride, best_ptr, idx_ptr, m_ptr, s_ptr, tok_ptr, lp_ptr, n_chunks,
                   BLOCK: tl.constexpr, LOGPROBS: tl.constexpr, PDL: tl.constexpr):
    """Row r's token: the index of the first chunk with the best score (chunks are in index order, so ties still
    go to the lowest index; an all -inf row takes index 0); with LOGPROBS its log-prob, logit - logsumexp."""
    wait_for_producers(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    ok = c < n_chunks
    best = tl.load(best_ptr + row * n_chunks + c, mask=ok, other=float("-inf"))
    top = tl.max(best, axis=0)
    won = tl.min(tl.where(ok & (best == top), c, BLOCK), axis=0)
    tok = tl.load(idx_ptr + row * n_chunks + won).to(tl.int64)
    tl.store(tok_ptr + row, tok)
    if LOGPROBS:
        m = tl.load(m_ptr + row * n_chunks + c, mask=ok, other=float("-inf"))
        s = tl.load(s_ptr + row * n_chunks + c, mask=ok, other=0.0)
        big = tl.max(m, axis=0)
        safe = tl.where(big == float("-inf"), 0.0, big)
        lse = safe + tl.log(tl.sum(s * tl.exp(m - safe), axis=0))
        x = tl.load(logits_ptr + row * stride + tok).to(tl.float32)
        tl.store(lp_ptr + row, x - lse)


def sample(logits: Tensor, temperature: Tensor, seeds: Tensor, steps: Tensor,
           logprobs: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """logits [B, V] (any float dtype, untempered, -inf for masked tokens); temperature [B] float (0 =
    greedy); seeds [B] int64; steps [B] int64 (the row's draw number). -> tokens [B] int64, and with
    `logprobs` also [B] fp32 log-softmax of the logits (in fp32, untempered) at each token."""
    b, v = logits.shape
    dev = logits.device
    for name, t in (("temperature", temperature), ("seeds", seeds), ("steps", steps)):
        if t.shape != (b,) or t.device != dev:
            raise ValueError(f"{name} must be a [{b}] tensor on {dev}, got {tuple(t.shape)} on {t.device}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    tokens = torch.empty(b, dtype=torch.int64, device=dev)
    lp = torch.empty(b if logprobs else 0, dtype=torch.float32, device=dev)
    if b == 0:
        return (tokens, lp) if logprobs else tokens
    chunk = min(_CHUNK, triton.next_power_of_2(v))
    n_chunks = triton.cdiv(v, chunk)
    part = torch.empty((3 if logprobs else 1, b, n_chunks), dtype=torch.float32, device=dev)
    best = part[0]
    m, s = (part[1], part[2]) if logprobs else (best, best)  # (never written or read without LOGPROBS)
    idx = torch.empty((b, n_chunks), dtype=torch.int32, device=dev)
    pdl = use_pdl(logits.device)
    _sample_kernel[(b, n_chunks)](logits, logits.stride(0), v, temperature.float(), seeds.long(), steps.long(), best,
                                  idx, m, s, n_chunks, CHUNK=chunk, LOGPROBS=logprobs, PDL=pdl, launch_pdl=pdl,
                                  num_warps=4)  # fmt: skip
    _finish_kernel[(b,)](logits, logits.stride(0), best, idx, m, s, tokens, lp, n_chunks,
                         BLOCK=triton.next_power_of_2(n_chunks), LOGPROBS=logprobs, PDL=pdl, launch_pdl=pdl,
                         num_warps=1)  # fmt: skip
    return (tokens, lp) if logprobs else tokens
