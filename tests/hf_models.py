"""Tiny random transformers models saved with `save_pretrained`: the oracles nobody on this project wrote."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

FAMILIES = ("qwen3", "qwen3_moe", "deepseek_v3")

# Several configs per family: odd head counts, GQA ratios, top-k, first-k-dense, tied/untied embeddings, YaRN.
CONFIGS: dict[str, dict] = {
    "qwen3-gqa2": dict(family="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "qwen3-odd-heads-tied": dict(family="qwen3", num_attention_heads=3, num_key_value_heads=1, head_dim=64,
                                 tie_word_embeddings=True),
    "qwen3-mha-bias": dict(family="qwen3", num_attention_heads=5, num_key_value_heads=5, head_dim=12,
                           attention_bias=True),
    "qwen3_moe-top2": dict(family="qwen3_moe", num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
    "qwen3_moe-top3-sparse-step": dict(family="qwen3_moe", num_experts=6, num_experts_per_tok=3,
                                       norm_topk_prob=False, num_hidden_layers=3, decoder_sparse_step=2,
                                       mlp_only_layers=[2], tie_word_embeddings=True),
    "deepseek_v3-qlora": dict(family="deepseek_v3", q_lora_rank=64, first_k_dense_replace=1),
    "deepseek_v3-no-qlora-yarn": dict(family="deepseek_v3", q_lora_rank=None, first_k_dense_replace=0,
                                      n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3,
                                      rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                       "original_max_position_embeddings": 64,
                                                       "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                                                       "mscale_all_dim": 0.707},
                                      max_position_embeddings=256),
    "deepseek_v3-not-interleaved-tied": dict(family="deepseek_v3", rope_interleave=False, tie_word_embeddings=True,
                                             num_attention_heads=3, num_key_value_heads=3),
}


def hf_config(family: str, **kw) -> transformers.PretrainedConfig:
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, rms_norm_eps=1e-6,
                  max_position_embeddings=128)
    if family == "qwen3":
        base = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        return transformers.Qwen3Config(**{**common, **base, **kw})
    if family == "qwen3_moe":
        base = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                    moe_intermediate_size=64)
        return transformers.Qwen3MoeConfig(**{**common, **base, **kw})
    if family == "deepseek_v3":
        base = dict(num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                    moe_intermediate_size=64, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
                    q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                    routed_scaling_factor=2.5, norm_topk_prob=True)
        return transformers.DeepseekV3Config(**{**common, **base, **kw})
    raise ValueError(family)


def make_hf_model(name_or_family: str, seed: int = 0, **kw) -> transformers.PreTrainedModel:
    spec = dict(CONFIGS.get(name_or_family, {"family": name_or_family}))
    family = spec.pop("family")
    cfg = hf_config(family, **{**spec, **kw})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # HF initialises these to zero/one; randomise so that they are actually tested
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    return model.eval()


def save_hf_model(model: transformers.PreTrainedModel, path: Path) -> Path:
    model.save_pretrained(path)
    return path


def padded_batch(vocab: int, lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded random batch -> (input_ids, attention_mask, position_ids)."""
    g = torch.Generator().manual_seed(seed)
    t = max(lengths)
    ids = torch.randint(0, vocab, (len(lengths), t), generator=g)
    mask = torch.zeros(len(lengths), t, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, t - n :] = 1
    ids = ids * mask  # pad id 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, pos


def hf_from_export(state_dict: dict, src_dir: Path, out_dir: Path) -> transformers.PreTrainedModel:
    """Write an exported HF state dict next to the source config.json and load it with transformers."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state_dict.items()}, out_dir / "model.safetensors")
    (out_dir / "config.json").write_text((Path(src_dir) / "config.json").read_text())
    return transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()


def peft_oracle_max_diff(ours, src_dir: Path, adapter_dir: Path, work_dir: Path, seed: int = 4):
    """-> (max |logit diff| of our model vs `peft.PeftModel.from_pretrained` on transformers loaded from our
    exported (dequantized) base over a left-padded batch; how much our adapter moves the logits (non-vacuity);
    the adapter keys PEFT itself would save)."""
    import peft

    from orbit_lightning import export_hf_state_dict

    hf = hf_from_export(export_hf_state_dict(ours, dtype=torch.float32), src_dir, work_dir / "exported")
    ref_model = peft.PeftModel.from_pretrained(hf, adapter_dir).eval()
    ids, mask, pos = padded_batch(hf.config.vocab_size, [9, 5, 7], seed=seed)
    real = mask.bool()
    with torch.no_grad():
        ref = ref_model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        got = ours(ids, attention_mask=mask)
        with ours.disable_adapter():
            base = ours(ids, attention_mask=mask)
    keys = set(peft.get_peft_model_state_dict(ref_model))
    return (got[real] - ref[real]).abs().max().item(), (got[real] - base[real]).abs().max().item(), keys
