"""`orbit-rl mode=plan_memory`: what a config needs per GPU, computed from the model built on the meta device
(no weights are allocated), so it works for 1T-parameter shapes on a laptop."""

from __future__ import annotations

import torch

from .experiment import ExperimentConfig


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def dequant_transient(model: torch.nn.Module) -> int:
    """Bytes of the largest weight that large batches (prefill, training) dequantize at once: one packed linear, or
    one chunk of one projection of packed experts (`model.expert_chunk_mib`). Decode reads the packed bytes."""
    from .quant.experts import QuantExperts
    from .quant.linear import QuantLinear

    sizes = [0]
    for m in model.modules():
        if isinstance(m, QuantLinear):
            sizes.append(m.out_features * m.in_features * m.compute_dtype.itemsize)
        elif isinstance(m, QuantExperts):
            sizes.append(min(m.experts_per_chunk(), m.num_experts) * m.projection_bytes())
    return max(sizes)


def plan_memory(cfg: ExperimentConfig) -> str:
    from . import add_adapter
    from .build import peft_config, resolve_model_path, set_expert_chunks
    from .models import load_model

    dtype = getattr(torch, cfg.model.dtype)
    model = load_model(resolve_model_path(cfg.model.path), dtype=dtype, device="meta", quant=cfg.model.quant,
                       int4_layout=cfg.model.int4_layout, **cfg.model.overrides)
    set_expert_chunks(model, cfg.model.expert_chunk, cfg.model.expert_chunk_mib)
    add_adapter(model, peft_config(cfg.adapter), slots=("slot0", "slot1"))
    mc = model.config
    frozen = sum(_bytes(b) for b in model.buffers()) + sum(_bytes(p) for p in model.parameters() if not p.requires_grad)
    adapter = sum(_bytes(p) for p in model.parameters() if p.requires_grad)
    optim = 2 * adapter * 4 // max(1, torch.finfo(dtype).bits // 8)  # AdamW m and v in fp32
    engine_slots = 2 * adapter
    kv_heads = mc.num_attention_heads if mc.is_mla else mc.num_key_value_heads
    k_dim = (mc.qk_nope_head_dim + mc.qk_rope_head_dim) if mc.is_mla else mc.head_dim
    v_dim = mc.v_head_dim if mc.is_mla else mc.head_dim
    seq = cfg.rollout.max_new_tokens + cfg.data.max_prompt_tokens
    n_seq = cfg.data.prompts_per_step * cfg.rollout.group_size
    kv = n_seq * seq * mc.num_hidden_layers * kv_heads * (k_dim + v_dim) * torch.finfo(dtype).bits // 8
    rows = [("frozen base (packed, as deployed)", frozen), ("adapter (train slot)", adapter),
            ("adapter gradients", adapter), ("AdamW state (fp32)", optim), ("engine adapter slots (x2)", engine_slots),
            (f"KV cache for {n_seq} sequences x {seq} tokens", kv),
            ("dequantized transient (weight or expert chunk)", dequant_transient(model))]
    total = sum(b for _, b in rows)
    lines = [f"memory plan: {cfg.model.path} quant={cfg.model.quant} dtype={cfg.model.dtype}"]
    lines += [f"  {name:<48} {b / 2**30:10.3f} GiB" for name, b in rows]
    lines.append(f"  {'total (activations excluded)':<48} {total / 2**30:10.3f} GiB")
    return "\n".join(lines)
