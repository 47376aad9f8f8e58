"""Named model shapes: tiny ones for tests and the default experiment, real shapes for GPU benchmarks.

Presets have no files. Tiny presets are randomly initialised; benchmark shapes are meant to be built with a
`quant=` format so their weights are generated directly in packed form (never materialised in BF16).
"""

from __future__ import annotations

from typing import Any

_BASE = dict(rms_norm_eps=1e-6, max_position_embeddings=4096, rope_parameters={"rope_type": "default",
                                                                                "rope_theta": 1e6})

PRESETS: dict[str, dict[str, Any]] = {
    "tiny-qwen3": dict(model_type="qwen3", vocab_size=256, hidden_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128),
    "tiny-qwen3-moe": dict(model_type="qwen3_moe", vocab_size=256, hidden_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                           num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    "tiny-deepseek-v3": dict(model_type="deepseek_v3", vocab_size=256, hidden_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
                             n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_group=2,
                             topk_group=1, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32,
                             kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                             routed_scaling_factor=2.5, norm_topk_prob=True),
    # Real shapes (random weights) for benchmarks on the GPU machine.
    "qwen3-0.6b": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                       tie_word_embeddings=True),
    "qwen3-1.7b": dict(model_type="qwen3", vocab_size=151936, hidden_size=2048, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=6144,
                       tie_word_embeddings=True),
    "qwen3-4b": dict(model_type="qwen3", vocab_size=151936, hidden_size=2560, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=9728,
                     tie_word_embeddings=True),
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=12288),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
    "qwen3-235b-a22b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=4096, num_hidden_layers=94,
                            num_attention_heads=64, num_key_value_heads=4, head_dim=128, intermediate_size=12288,
                            num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536,
                            norm_topk_prob=True),
    "deepseek-v3": dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, num_hidden_layers=61,
                        num_attention_heads=128, num_key_value_heads=128, intermediate_size=18432,
                        n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048, n_group=8,
                        topk_group=4, n_shared_experts=1, first_k_dense_replace=3, q_lora_rank=1536,
                        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                        routed_scaling_factor=2.5, norm_topk_prob=True,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                         "original_max_position_embeddings": 4096, "beta_fast": 32,
                                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
}
PRESETS["kimi-k2"] = {**PRESETS["deepseek-v3"], "vocab_size": 163840, "num_attention_heads": 64,
                      "num_key_value_heads": 64, "n_routed_experts": 384, "n_group": 1, "topk_group": 1,
                      "first_k_dense_replace": 1, "routed_scaling_factor": 2.827}


def preset_hf_config(name: str, **overrides: Any) -> dict[str, Any]:
    """The HF-style config dict of a preset; `overrides` (e.g. num_hidden_layers=4) change the shape."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(sorted(PRESETS))}")
    return {**_BASE, **PRESETS[name], **overrides}
