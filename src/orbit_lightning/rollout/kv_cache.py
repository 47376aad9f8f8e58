"""The paged KV cache and the attention context that reads and writes it.

Storage per K and V: one tensor [layers, blocks, block_size, kv_heads, head_dim]. MLA uses the simple layout:
the per-head expanded k [H, nope+rope] and v [H, v_dim] that `MLAttention` hands to `ctx.attend` (a latent
layout would store ~10x less; it needs an MLA-aware attention kernel).

`PagedAttention` implements the models' `AttentionContext`: each layer writes its new k/v into the sequences'
cache slots, then
- prefill (nothing cached before this forward): attends over the new k/v directly with a causal + key-validity
  mask, which is the trainer's teacher-forcing attention (`models.cache.causal_mask` + `masked_attention`);
- decode: attends each sequence's one query over its first `context_len` keys, reading them through the block
  table in `kernels.paged_attention` on CUDA (and in batch-invariant mode), else gathering the blocks first.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor

from ..models import invariant
from ..models.cache import causal_attention, causal_mask, masked_attention
from ..models.config import ModelConfig
from ..triton_kernels import kernels_module, kernels_run_on

# Decode on CUDA reads keys/values through the block table in the attention kernel (no gather copy). False:
# gather the blocks, then SDPA (the CPU path; kept on CUDA for A/B benchmarks).
PAGED_KERNEL = True


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    k_dim: int
    v_dim: int
    dtype: torch.dtype

    @classmethod
    def from_config(cls, cfg: ModelConfig, dtype: torch.dtype) -> KVLayout:
        if cfg.is_mla:
            return cls(cfg.num_hidden_layers, cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
                       cfg.v_head_dim, dtype)
        return cls(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cfg.head_dim, dtype)

    def bytes_per_token(self) -> int:
        elem = torch.empty(0, dtype=self.dtype).element_size()
        return self.num_layers * self.num_kv_heads * (self.k_dim + self.v_dim) * elem


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class PagedKVCache:
    def __init__(self, layout: KVLayout, num_blocks: int, block_size: int, device: torch.device):
        self.layout, self.num_blocks, self.block_size = layout, num_blocks, block_size
        shape = (layout.num_layers, num_blocks, block_size, layout.num_kv_heads)
        # Zeros, not empty: masked-out keys still pass through softmax·V, and 0 · NaN garbage would be NaN.
        self.k = torch.zeros(*shape, layout.k_dim, dtype=layout.dtype, device=device)
        self.v = torch.zeros(*shape, layout.v_dim, dtype=layout.dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy-on-write: dst blocks get src blocks' contents, in every layer."""
        if src:
            s = torch.tensor(src, device=self.k.device)
            d = torch.tensor(dst, device=self.k.device)
            self.k[:, d] = self.k[:, s]
            self.v[:, d] = self.v[:, s]

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """slots [N] flat slot ids (block * block_size + offset); k [N, Hkv, dk], v [N, Hkv, dv]. One launch on
        CUDA (kernels.kv_write), two index copies elsewhere: the same copied values either way."""
        kc, vc = self.k[layer].view(-1, *k.shape[1:]), self.v[layer].view(-1, *v.shape[1:])
        if k.is_cuda and kernels_run_on(k.device) and k.stride(-1) == 1 and v.stride(-1) == 1:
            kernels_module().kv_write(kc, vc, slots, k, v)
            return
        kc.index_copy_(0, slots, k.to(self.k.dtype))
        vc.index_copy_(0, slots, v.to(self.v.dtype))

    def gather(self, layer: int, block_tables: Tensor) -> tuple[Tensor, Tensor]:
        """block_tables [B, W] -> k [B, Hkv, W*block_size, dk], v [B, Hkv, W*block_size, dv]."""
        b, w = block_tables.shape
        k = self.k[layer][block_tables].view(b, w * self.block_size, *self.k.shape[-2:]).transpose(1, 2)
        v = self.v[layer][block_tables].view(b, w * self.block_size, *self.v.shape[-2:]).transpose(1, 2)
        return k, v


class PagedAttention:
    """One forward's view of the cache. Build with `prefill(...)` or `decode(...)`; pass as `ctx` to the model."""

    def __init__(self, cache: PagedKVCache, slots: Tensor, allowed: Tensor, block_tables: Tensor | None,
                 context_lens: Tensor | None = None):
        self.cache = cache
        self.context_lens = context_lens  # [B] for decode
        self.slots = slots  # [B, T] int64 flat slot per new token (padding -> the null block)
        self.allowed = allowed  # [B, 1, T, S] bool
        self.block_tables = block_tables  # [B, W] for decode; None for prefill (attend to the new k/v)

    @classmethod
    def prefill(cls, cache: PagedKVCache, slots: Tensor, valid: Tensor) -> PagedAttention:
        """slots [B, T]; valid [B, T] bool (right padding is False)."""
        t = valid.shape[1]
        return cls(cache, slots, causal_mask(valid, t, t, valid.device), None)

    @classmethod
    def decode(cls, cache: PagedKVCache, slots: Tensor, block_tables: Tensor, context_lens: Tensor) -> PagedAttention:
        """slots [B, 1]; block_tables [B, W]; context_lens [B] keys per sequence including the new token."""
        s = block_tables.shape[1] * cache.block_size
        allowed = torch.arange(s, device=slots.device)[None, :] < context_lens[:, None]
        return cls(cache, slots, allowed[:, None, None, :], block_tables, context_lens)

    def attend(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """q [B, H, T, dk], k [B, Hkv, T, dk], v [B, Hkv, T, dv] -> [B, H, T, dv]."""
        b, h, t, _ = k.shape
        self.cache.write(layer_idx, self.slots.reshape(-1), k.transpose(1, 2).reshape(b * t, h, -1),
                         v.transpose(1, 2).reshape(b * t, h, -1))
        if self.block_tables is None:
            return causal_attention(q, k, v, self.allowed, scale)  # right padding only: no kv_start
        if t == 1 and (invariant.use_kernels(q) or (q.is_cuda and PAGED_KERNEL and kernels_run_on(q.device))):
            # (paged_attention itself never splits keys in batch-invariant mode: decode then reduces as prefill)
            return kernels_module().paged_attention(q, self.cache.k[layer_idx], self.cache.v[layer_idx],
                                                    self.block_tables, self.context_lens, scale)
        kc, vc = self.cache.gather(layer_idx, self.block_tables)
        kc, vc = kc.to(q.dtype), vc.to(q.dtype)
        if t > 1 or q.shape[1] == h:
            return masked_attention(q, kc, vc, self.allowed, scale)
        # GQA decode: the `rep` query heads of a kv head become `rep` query rows against that head's keys (head
        # i reads kv head i // rep, as in repeat_interleave), so the gathered keys are not repeated per head.
        rep = q.shape[1] // h
        out = masked_attention(q.reshape(b, h, rep, -1), kc, vc, self.allowed, scale)  # [B, Hkv, rep, dv]
        return out.reshape(b, h * rep, 1, -1)
