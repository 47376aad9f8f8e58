"""Softmax top-k routing (Qwen3-MoE's router after its logits GEMM) in one launch.

torch runs it as a softmax, a top-k (a radix select and a bitonic sort of the k: two launches), the renormalizing sum
and division and the cast: ~6 launches, ~14 us per MoE layer at batch 1 on an H200, where the layer's experts read
~20 us of weights (bench/RESULTS.md). Here a program takes a block of rows: fp32 softmax over the experts, then k
rounds of max / argmax (the lowest index among equal probabilities, NaN first as in torch.topk), the renormalization
and the cast. Each row is reduced on its own, so results do not depend on the batch (batch-invariant by
construction).

The probabilities are torch's formula (exp(l - max) / sum) in fp32; exp and the sum's order differ from torch's
kernels by a few fp32 ulps, so on near-ties the chosen experts may differ from torch.topk's. Engine and trainer both
take this kernel on CUDA, so they agree with each other.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .pdl import use_pdl, wait_for_producers

_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _softmax_topk_kernel(logits_ptr, w_ptr, ids_ptr, T, E, stride_l, K: tl.constexpr, RENORM: tl.constexpr,
                         BT: tl.constexpr, E_POW2: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    wait_for_producers(PDL)
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    e = tl.arange(0, E_POW2)
    ok = (rows < T)[:, None] & (e < E)[None, :]
    logits = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_l + e[None, :], mask=ok, other=-float("inf"))
    logits = tl.where((rows < T)[:, None], logits.to(tl.float32), 0.0)  # (rows past T: zeros, never stored)
    z = tl.exp(logits - tl.max(logits, 1)[:, None])
    p = z / tl.sum(z, 1)[:, None]
    # Ranks: NaN first, as torch.topk orders it (a row with a NaN or +inf logit is all NaN: its weights stay NaN, its
    # ids valid), padding experts never; chosen experts drop below both.
    rank = tl.where(e[None, :] < E, tl.where(p != p, float("inf"), p), -1.0)
    picked_w = tl.zeros((BT, K), tl.float32)
    picked_i = tl.zeros((BT, K), tl.int32)
    slot = tl.arange(0, K)
    for j in tl.static_range(K):  # descending, as torch.topk returns them
        best = tl.max(rank, 1)
        idx = tl.min(tl.where(rank == best[:, None], e[None, :], E_POW2), 1)  # the lowest index among equals
        chosen = e[None, :] == idx[:, None]
        picked_w = tl.where(slot[None, :] == j, tl.sum(tl.where(chosen, p, 0.0), 1)[:, None], picked_w)
        picked_i = tl.where(slot[None, :] == j, idx[:, None], picked_i)
        rank = tl.where(chosen, -2.0, rank)
    if RENORM:
        picked_w = picked_w / tl.sum(picked_w, 1)[:, None]
    out = rows[:, None].to(tl.int64) * K + slot[None, :]
    keep = (rows < T)[:, None]
    tl.store(w_ptr + out, picked_w.to(w_ptr.dtype.element_ty), mask=keep)
    tl.store(ids_ptr + out, picked_i.to(tl.int64), mask=keep)


def softmax_topk(logits: Tensor, k: int, renormalize: bool, out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Router logits [T, E] -> (weights [T, k] in out_dtype, expert ids int64 [T, k]): softmax over E in fp32, the k
    largest probabilities in descending order, divided by their sum if `renormalize`. No autograd (models.moe
    differentiates torch's formula for the gradient)."""
    if logits.dim() != 2 or logits.dtype not in _OUT_DTYPES:
        raise ValueError(f"softmax_topk takes [tokens, experts] bf16/fp16/fp32 logits, got {tuple(logits.shape)} "
                         f"{logits.dtype}")
    t, e = logits.shape
    if not 1 <= k <= e or k & (k - 1):
        raise ValueError(f"softmax_topk picks a power-of-two k of at most the {e} experts, got k={k}")
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"softmax_topk writes bf16/fp16/fp32 weights, not {out_dtype}")
    w = torch.empty((t, k), dtype=out_dtype, device=logits.device)
    ids = torch.empty((t, k), dtype=torch.int64, device=logits.device)
    if t == 0:
        return w, ids
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    e_pow2 = triton.next_power_of_2(e)
    bt = max(1, min(triton.next_power_of_2(t), 2048 // e_pow2))  # ~16 probabilities per thread
    pdl = use_pdl(logits.device)
    _softmax_topk_kernel[(triton.cdiv(t, bt),)](
        logits, w, ids, t, e, logits.stride(0), K=k, RENORM=renormalize, BT=bt, E_POW2=e_pow2, PDL=pdl,
        launch_pdl=pdl, num_warps=4,
    )  # fmt: skip
    return w, ids
