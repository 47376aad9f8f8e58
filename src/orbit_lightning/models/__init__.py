from .config import ModelConfig, RopeConfig
from .decoder import CausalLM
from .loader import load_model
from .logprobs import token_logprobs
from .presets import PRESETS, preset_hf_config

__all__ = ["CausalLM", "ModelConfig", "RopeConfig", "PRESETS", "load_model", "preset_hf_config", "token_logprobs"]
