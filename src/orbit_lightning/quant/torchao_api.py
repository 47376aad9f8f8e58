"""Our packed formats as torchao configs: `torchao.quantization.quantize_(model, Int4GroupConfig())` works.

Decision: torchao's API over our own module types, not a torchao tensor subclass.
Each config (a dataclass subclassing `AOBaseConfig`) is registered with torchao's
`register_quantize_module_handler`; the handler swaps an `nn.Linear` for our `QuantLinear` and routed
`Experts` for `QuantExperts` through the functions `quantize_model` uses, so the result is bit-identical.
A weight tensor subclass (torchao's `Int4Tensor`, `Float8Tensor`, ...) does not fit our invariants:
- Routed experts are 3-D `[E, N, K]` parameters that are never a matmul operand as a whole: our MoE path
  indexes the *active* experts and dequantizes a chunk at a time. A subclass would have to implement
  indexing, grouped matmul and the chunked backward through `__torch_dispatch__` for every format.
- Backward must compute dX only, dequantizing again instead of keeping a BF16 copy. We own that in one
  autograd.Function per module type; with a subclass, F.linear's backward would dispatch `mm(dY, W)` into it,
  so every format would need the transposed matmul in `__torch_dispatch__`, and aten decides what is saved.
- Checkpoints must keep compressed-tensors / DeepSeek buffer names (`weight_packed`, `weight_scale`,
  `weight_shape`, `weight_scale_inv`), so pre-quantized checkpoints load as is and export without conversion;
  a subclass is one `weight` entry with its own inner names.
- One packed layout is shared by the pure-torch reference, the Triton kernels and the rollout engine
  (invariant: one forward path); torchao's subclasses bring their own layouts and kernels.

How to call it (torchao 0.18 semantics):
- Default `filter_fn` selects every `nn.Linear`, *including lm_head*, and no routed experts (they are not
  `nn.Linear`). `quantize_model` keeps lm_head in its own dtype; to get the same set of modules, pass
  `filter_fn=linear_or_experts` (nn.Linear and Experts, lm_head excluded).
- Per-module choices: `quantize_(model, FqnToConfig({...}), filter_fn=None)`; torchao requires
  `filter_fn=None` with FqnToConfig. Keys are module fqns, parameter fqns or "re:" regexes matched in
  full. A parameter-level match calls the handler with `parameter_name`.
- Broad regexes such as `re:.*self_attn\\..*` also cover norms, and `re:.*experts` covers DeepSeek's
  `shared_experts` container. The handler returns any module that holds no linear weight unchanged. Write a
  regex that names the module (`re:.*mlp\\.experts`) when that matters.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

from torch import nn
from torchao.core.config import AOBaseConfig
from torchao.quantization.transform_module import register_quantize_module_handler

from ..models.moe import Experts
from .apply import quantize_experts, quantize_linear
from .experts import QuantExperts
from .formats import Fp8BlockFormat, Int4Format, MXFP4Format, NF4Format, NVFP4Format, QuantFormat
from .linear import QuantLinear


class PackedConfig(AOBaseConfig):
    """A torchao config that names one of our packed formats."""

    @abstractmethod
    def quant_format(self) -> QuantFormat: ...

    def __post_init__(self):
        self.quant_format()  # bad parameters (e.g. a group size we do not support) fail here, not mid-model


@dataclass(frozen=True)
class Int4GroupConfig(PackedConfig):
    """Symmetric int4, one bf16 scale per `group_size` along K (compressed-tensors pack-quantized); `tiled`: stored in
    the decode kernels' block layout (int4-tiled, quant/formats/tiled.py) where a layer's shape allows."""

    group_size: int = 32
    tiled: bool = False

    def quant_format(self) -> QuantFormat:
        return Int4Format(group_size=self.group_size, tiled=self.tiled)


@dataclass(frozen=True)
class Fp8BlockConfig(PackedConfig):
    """e4m3 with one fp32 scale per `block` (rows, cols) tile (DeepSeek-V3's `weight_scale_inv`)."""

    block: tuple[int, int] = (128, 128)

    def quant_format(self) -> QuantFormat:
        return Fp8BlockFormat(block=self.block)


@dataclass(frozen=True)
class MXFP4Config(PackedConfig):
    """e2m1 with an e8m0 scale per 32."""

    def quant_format(self) -> QuantFormat:
        return MXFP4Format()


@dataclass(frozen=True)
class NVFP4Config(PackedConfig):
    """e2m1 with an e4m3 scale per 16 and an fp32 global scale per matrix."""

    def quant_format(self) -> QuantFormat:
        return NVFP4Format()


@dataclass(frozen=True)
class NF4Config(PackedConfig):
    """QLoRA NormalFloat4, absmax per 64 (bitsandbytes-compatible bytes, pure torch)."""

    def quant_format(self) -> QuantFormat:
        return NF4Format()


CONFIGS: tuple[type[PackedConfig], ...] = (
    Int4GroupConfig, Fp8BlockConfig, MXFP4Config, NVFP4Config, NF4Config,
)


def linear_or_experts(module: nn.Module, fqn: str) -> bool:
    """`filter_fn` for `quantize_` that selects what `quantize_model` packs: linears and routed experts,
    lm_head excluded."""
    return isinstance(module, (nn.Linear, Experts)) and not fqn.endswith("lm_head")


def pack_module(module: nn.Module, config: PackedConfig, *, parameter_name: str | None = None) -> nn.Module:
    """torchao handler: the packed replacement of `module`, or `module` itself if it holds no linear weight.

    `parameter_name` is set when FqnToConfig matched a parameter fqn: a linear's `weight` or an expert
    projection packs the whole module (one format per module); any other parameter (a bias, a norm weight)
    leaves the module as it is.
    """
    fmt = config.quant_format()
    if isinstance(module, (QuantLinear, QuantExperts)):
        if module.fmt != fmt:
            raise ValueError(f"{type(module).__name__} is already packed as {module.fmt.name!r}; cannot "
                             f"re-pack it as {fmt.name!r} (quantize a float model instead)")
        return module  # FqnToConfig visits a swapped module again for its other parameters
    if isinstance(module, nn.Linear) and parameter_name in (None, "weight"):
        return quantize_linear(module, fmt)
    if type(module) is Experts and parameter_name in (None, *Experts.PROJECTIONS):
        return quantize_experts(module, fmt)
    return module


for _cls in CONFIGS:
    register_quantize_module_handler(_cls)(pack_module)
