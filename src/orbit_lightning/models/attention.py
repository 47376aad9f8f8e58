"""Attention layers: grouped-query attention with q/k RMSNorm (Qwen3) and multi-head latent attention (DeepSeek-V3)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..quant.fusion import project
from .cache import AttentionContext
from .config import ModelConfig
from .layers import RMSNorm, Rotary, apply_rope_qk, norm_rope_qk


class GQAttention(nn.Module):
    FUSED_INPUTS = (("q_proj", "k_proj", "v_proj"),)  # read x together at decode (quant.fusion)

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        d, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(d, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.scale = self.head_dim**-0.5

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], ctx: AttentionContext) -> Tensor:
        b, t, _ = x.shape
        q, k, v = project(x, (self.q_proj, self.k_proj, self.v_proj))
        q, k = norm_rope_qk(q.view(b, t, self.n_heads, self.head_dim), k.view(b, t, self.n_kv, self.head_dim),
                            self.q_norm, self.k_norm, *rope)  # fmt: skip
        v = v.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        out = ctx.attend(self.layer_idx, q, k, v, self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLAttention(nn.Module):
    """DeepSeek-V2/V3 MLA. Keys/values come from a low-rank latent; rotary dims are decoupled and shared by heads.

    The cache sees expanded per-head k [B, H, T, nope+rope] and v [B, H, T, dv] (the simple layout).
    """

    FUSED_INPUTS = (("q_proj", "kv_a_proj_with_mqa"), ("q_a_proj", "kv_a_proj_with_mqa"))

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        d, h = cfg.hidden_size, cfg.num_attention_heads
        self.n_heads = h
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        qk_dim = self.nope + self.rope_dim
        bias = cfg.attention_bias
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(d, h * qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.kv_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_rank, h * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(h * self.v_dim, d, bias=bias)
        self.interleave = cfg.rope.interleave
        self.scale = qk_dim**-0.5
        rc = cfg.rope
        if rc.type == "yarn" and rc.mscale_all_dim:
            # DeepSeek folds YaRN's attention temperature into the softmax scale as well.
            m = 0.1 * rc.mscale_all_dim * math.log(rc.factor) + 1.0 if rc.factor > 1 else 1.0
            self.scale *= m * m

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], ctx: AttentionContext) -> Tensor:
        b, t, _ = x.shape
        if hasattr(self, "q_proj"):
            q, kv_a = project(x, (self.q_proj, self.kv_a_proj_with_mqa))
        else:
            q_a, kv_a = project(x, (self.q_a_proj, self.kv_a_proj_with_mqa))
            q = self.q_b_proj(self.q_a_layernorm(q_a))
        q = q.view(b, t, self.n_heads, -1).transpose(1, 2)
        q_nope, q_rot = q.split([self.nope, self.rope_dim], dim=-1)
        kv_latent, k_rot = kv_a.split([self.kv_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(kv_latent)).view(b, t, self.n_heads, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        cos, sin = rope
        q_rot, k_rot = apply_rope_qk(q_rot, k_rot.view(b, 1, t, self.rope_dim), cos, sin, self.interleave)
        q = torch.cat([q_nope, q_rot], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(b, self.n_heads, t, self.rope_dim)], dim=-1)
        out = ctx.attend(self.layer_idx, q, k, v, self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


def make_rotary(cfg: ModelConfig) -> Rotary:
    return Rotary(cfg.qk_rope_head_dim if cfg.is_mla else cfg.head_dim, cfg.rope)
