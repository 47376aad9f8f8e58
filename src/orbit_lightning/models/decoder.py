"""The decoder-only causal LM shared by every family; families differ only in attention and MLP blocks."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .attention import GQAttention, MLAttention, make_rotary
from .cache import AttentionContext, CausalContext
from .config import ModelConfig
from .layers import MLP, RMSNorm
from .moe import MoE


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = MLAttention(cfg, layer_idx) if cfg.is_mla else GQAttention(cfg, layer_idx)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(layer_idx) else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], ctx: AttentionContext,
                residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The layer on the stream x + residual, returned as (stream, mlp_out) for the caller to add: each residual
        add runs in one launch with the norm that follows it (RMSNorm.add_forward)."""
        x, h = self.input_layernorm.add_forward(x, residual)
        x, h = self.post_attention_layernorm.add_forward(x, self.self_attn(h, rope, ctx))
        return x, self.mlp(h)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = make_rotary(cfg)


class CausalLM(nn.Module):
    """`forward(input_ids, ...)` returns logits [B, T, V]; `hidden_states(...)` the final normed states [B, T, D].

    Module names mirror transformers' (`model.layers.N.self_attn.q_proj`, `lm_head`) so HF and PEFT keys map 1:1.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def hidden_states(
        self,
        input_ids: Tensor,  # [B, T] int64
        attention_mask: Tensor | None = None,  # [B, T] 1 = real token, 0 = (left) padding
        position_ids: Tensor | None = None,  # [B, T]; derived from the mask when omitted
        ctx: AttentionContext | None = None,  # KV cache / paged attention; teacher forcing when omitted
    ) -> Tensor:
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = positions_from_mask(attention_mask, b, t, input_ids.device)
        if ctx is None:
            ctx = CausalContext(attention_mask, t, input_ids.device)
        x = self.model.embed_tokens(input_ids)
        rope = self.model.rotary(position_ids)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, rope, ctx, residual)
        return self.model.norm.add_forward(x, residual)[1]

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, ctx: AttentionContext | None = None) -> Tensor:
        return self.lm_head(self.hidden_states(input_ids, attention_mask, position_ids, ctx))

    def disable_adapter(self):
        """Context manager: the reference policy, i.e. the same base with every adapter off (no extra weights)."""
        from ..adapters.slots import adapters_disabled

        return adapters_disabled(self)


def positions_from_mask(mask: Tensor | None, b: int, t: int, device: torch.device) -> Tensor:
    if mask is None:
        return torch.arange(t, device=device).expand(b, t)
    # Left padding: a sequence's first real token sits at position 0.
    return (mask.long().cumsum(-1) - 1).clamp(min=0)
