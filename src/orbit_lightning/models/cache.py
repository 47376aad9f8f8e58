"""How attention reaches keys and values: the hook the rollout engine plugs its KV cache into.

Every attention layer calls `ctx.attend(layer_idx, q, k, v, scale)` with the *new* tokens' q/k/v. The context
decides where k/v come from: `CausalContext` (training, teacher forcing: only the tokens given, causal + key
padding), `ContiguousKVCache` (a simple per-sequence cache for tests and small-batch decode) or the engine's
paged cache. One forward path serves all three; only the storage of k/v differs.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from ..triton_kernels import kernels_module
from . import invariant


class AttentionContext(Protocol):
    def attend(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """q [B, H, T, dk], k [B, Hkv, T, dk], v [B, Hkv, T, dv] -> [B, H, T, dv]."""
        ...


def masked_attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scale: float) -> Tensor:
    """Softmax attention with a boolean mask `allowed` [B, 1|H, Tq, Tk] (True = attend); GQA by head repeat."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)


def causal_mask(key_valid: Tensor | None, tq: int, tk: int, device: torch.device) -> Tensor:
    """[B|1, 1, tq, tk] bool: query i (the last tq of tk positions) sees keys <= its position that are valid.

    A fully masked row (a left-pad query) would give NaN from softmax; it is let to see itself, and its output
    is never used.
    """
    q_pos = torch.arange(tk - tq, tk, device=device)[:, None]
    k_pos = torch.arange(tk, device=device)[None, :]
    allowed = (k_pos <= q_pos)[None, None]
    if key_valid is not None:
        allowed = allowed & key_valid[:, None, None, :].bool()
        allowed = allowed | (k_pos == q_pos)[None, None]
    return allowed


def causal_attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scale: float,
                     kv_start: Tensor | None = None) -> Tensor:
    """Causal attention, queries aligned to the end of the keys. `allowed` is the mask of the torch path;
    in batch-invariant mode the kernel applies the same causal rule from `kv_start` [B] (first real key of
    each row, i.e. its left padding) instead, counting key blocks from there."""
    if not invariant.use_kernels(q):
        return masked_attention(q, k, v, allowed, scale)
    kernels = kernels_module()
    return invariant.with_reference_grad(
        lambda q_, k_, v_: kernels.attention(q_, k_, v_, scale, kv_start=kv_start),
        lambda q_, k_, v_: masked_attention(q_, k_, v_, allowed, scale), q, k, v)


def left_padding(mask: Tensor) -> Tensor:
    """[B] count of leading padding of a [B, T] mask that must be one run of real tokens per row (left and
    right padding only): the kernels count key blocks from the first real token."""
    valid = mask.bool()
    start = (valid.long().cumsum(-1) == 0).sum(-1)
    pos = torch.arange(mask.shape[1], device=mask.device)[None, :]
    run = (pos >= start[:, None]) & (pos < (start + valid.sum(-1))[:, None])
    if not bool((run == valid).all()):
        raise ValueError("batch-invariant attention needs each attention_mask row to be one run of 1s (left and "
                         "right padding only); got a mask with holes")
    return start


class CausalContext:
    """Teacher forcing over a full (possibly left-padded) batch: no cache."""

    def __init__(self, attention_mask: Tensor | None, seq_len: int, device: torch.device):
        self.mask = attention_mask
        self.allowed = causal_mask(attention_mask, seq_len, seq_len, device)
        self._kv_start: Tensor | None = None

    def attend(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        if self._kv_start is None and self.mask is not None and invariant.use_kernels(q):
            self._kv_start = left_padding(self.mask)
        return causal_attention(q, k, v, self.allowed, scale, self._kv_start)


class ContiguousKVCache:
    """A [B, Hkv, max_len, d] cache per layer; sequences are appended in lock-step (left padding allowed).

    Call `advance(new_valid)` once per forward *before* the model runs, with the validity [B, T_new] of the new
    tokens (0 for left padding).
    """

    def __init__(self, num_layers: int, max_len: int):
        self.num_layers = num_layers
        self.max_len = max_len
        self.k: list[Tensor | None] = [None] * num_layers
        self.v: list[Tensor | None] = [None] * num_layers
        self.length = 0
        self.valid: Tensor | None = None  # [B, length] bool
        self._allowed: Tensor | None = None

    def advance(self, new_valid: Tensor) -> None:
        t_new = new_valid.shape[1]
        if self.length + t_new > self.max_len:
            raise RuntimeError(
                f"KV cache full: {self.length} + {t_new} tokens > max_len={self.max_len}; "
                "create the cache with a larger max_len"
            )
        nv = new_valid.bool()
        self.valid = nv if self.valid is None else torch.cat([self.valid, nv], dim=1)
        self.length += t_new
        self._allowed = causal_mask(self.valid, t_new, self.length, new_valid.device)

    def attend(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        t_new = k.shape[2]
        start = self.length - t_new
        if self.k[layer_idx] is None:
            b, h = k.shape[:2]
            self.k[layer_idx] = k.new_zeros(b, h, self.max_len, k.shape[-1])
            self.v[layer_idx] = v.new_zeros(b, v.shape[1], self.max_len, v.shape[-1])
        kc, vc = self.k[layer_idx], self.v[layer_idx]
        kc[:, :, start:self.length] = k
        vc[:, :, start:self.length] = v
        return masked_attention(q, kc[:, :, :self.length], vc[:, :, :self.length], self._allowed, scale)
