"""One dataclass describes every supported decoder; it is parsed from (and written back to) HF `config.json`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe", "deepseek_v3", "kimi_k2")


@dataclass
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"  # "default" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    interleave: bool = False  # DeepSeek stores rotary dims as interleaved pairs


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    rope: RopeConfig = field(default_factory=RopeConfig)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # MoE (qwen3_moe, deepseek_v3)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    # DeepSeek-V3 router and shared experts
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    # DeepSeek-V3 multi-head latent attention
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    @property
    def is_mla(self) -> bool:
        return self.model_type in ("deepseek_v3", "kimi_k2")

    @property
    def router(self) -> str:
        return "sigmoid_grouped" if self.is_mla else "softmax"

    def is_moe_layer(self, layer_idx: int) -> bool:
        if self.num_experts == 0:
            return False
        if self.is_mla:
            return layer_idx >= self.first_k_dense_replace
        return layer_idx not in self.mlp_only_layers and (layer_idx + 1) % self.decoder_sparse_step == 0

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.eos_token_id
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    # ---- HF config.json <-> ModelConfig -------------------------------------------------------------

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r} in config.json; orbit-lightning supports "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if hf.get("use_sliding_window"):
            raise ValueError("use_sliding_window=true is not supported; set it to false in config.json")
        g = hf.get
        mla = model_type in ("deepseek_v3", "kimi_k2")
        heads = g("num_attention_heads")
        cfg = cls(
            model_type=model_type,
            vocab_size=g("vocab_size"),
            hidden_size=g("hidden_size"),
            num_hidden_layers=g("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=g("num_key_value_heads") or heads,
            intermediate_size=g("intermediate_size"),
            head_dim=None if mla else (g("head_dim") or g("hidden_size") // heads),
            rms_norm_eps=g("rms_norm_eps", 1e-6),
            max_position_embeddings=g("max_position_embeddings", 4096),
            tie_word_embeddings=bool(g("tie_word_embeddings", False)),
            attention_bias=bool(g("attention_bias", False)),
            rope=_rope_from_hf(hf, interleave=mla and g("rope_interleave", True)),
            bos_token_id=g("bos_token_id"),
            eos_token_id=g("eos_token_id"),
            pad_token_id=g("pad_token_id"),
            num_experts=g("num_experts") or g("n_routed_experts") or g("num_local_experts") or 0,
            num_experts_per_tok=g("num_experts_per_tok") or 0,
            moe_intermediate_size=g("moe_intermediate_size") or 0,
            norm_topk_prob=bool(g("norm_topk_prob", False)),
            decoder_sparse_step=g("decoder_sparse_step") or 1,
            mlp_only_layers=list(g("mlp_only_layers") or []),
            n_group=g("n_group") or 1,
            topk_group=g("topk_group") or 1,
            routed_scaling_factor=g("routed_scaling_factor") or 1.0,
            n_shared_experts=g("n_shared_experts") or 0,
            first_k_dense_replace=g("first_k_dense_replace") or 0,
            q_lora_rank=g("q_lora_rank"),
            kv_lora_rank=g("kv_lora_rank") or 0,
            qk_nope_head_dim=g("qk_nope_head_dim") or 0,
            qk_rope_head_dim=g("qk_rope_head_dim") or 0,
            v_head_dim=g("v_head_dim") or 0,
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
                   if getattr(self, k) is None]
        if missing:
            raise ValueError(f"config.json lacks required keys: {missing}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, {self.num_experts}]")
        if self.is_mla and self.num_experts and self.num_experts % self.n_group:
            raise ValueError(f"n_routed_experts={self.num_experts} is not divisible by n_group={self.n_group}")

    def to_hf(self) -> dict[str, Any]:
        """A config.json that transformers can load (used for presets and the shipped tiny model)."""
        d = {k: v for k, v in asdict(self).items() if k != "rope"}
        r = self.rope
        rope: dict[str, Any] = {"rope_type": r.type, "rope_theta": r.theta}
        if r.type == "yarn":
            rope.update(factor=r.factor, original_max_position_embeddings=r.original_max_position_embeddings,
                        beta_fast=r.beta_fast, beta_slow=r.beta_slow)
            for k in ("mscale", "mscale_all_dim", "attention_factor"):
                if getattr(r, k) is not None:
                    rope[k] = getattr(r, k)
        d["rope_parameters"] = rope
        d["rope_theta"] = r.theta
        if self.is_mla:
            d["n_routed_experts"] = d.pop("num_experts")
            d["rope_interleave"] = r.interleave
            del d["head_dim"]
        else:
            del d["q_lora_rank"]
        if self.model_type == "qwen3_moe":
            d["num_local_experts"] = d["num_experts"]
        d["architectures"] = [_ARCH[self.model_type]]
        return d


_ARCH = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "kimi_k2": "DeepseekV3ForCausalLM",
}


def _rope_from_hf(hf: dict[str, Any], interleave: bool) -> RopeConfig:
    # transformers v5 writes `rope_parameters`; v4 checkpoints carry `rope_theta` + `rope_scaling`.
    params = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    params = {**legacy, **params}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise ValueError(f"rope type {rope_type!r} is not supported (supported: default, yarn)")
    rc = RopeConfig(theta=float(theta), type=rope_type, interleave=bool(interleave))
    if rope_type == "yarn":
        orig = params.get("original_max_position_embeddings")
        factor = params.get("factor")
        if factor is None:
            factor = hf["max_position_embeddings"] / orig
        rc.factor = float(factor)
        rc.original_max_position_embeddings = orig
        rc.beta_fast = float(params.get("beta_fast") or 32)
        rc.beta_slow = float(params.get("beta_slow") or 1)
        rc.mscale = params.get("mscale")
        rc.mscale_all_dim = params.get("mscale_all_dim")
        rc.attention_factor = params.get("attention_factor")
        rc.truncate = bool(params.get("truncate", True))
    return rc
