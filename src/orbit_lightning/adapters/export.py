"""`export_hf_state_dict`: the base weights under transformers' names (per-expert keys), for deployment and as
the oracle of the quantized path. Adapters are not merged: export them with `save_adapter`."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..models.moe import Experts


def _hf_path(path: str) -> str:
    return ".".join(p for p in path.split(".") if p != "base_layer")


@torch.no_grad()
def export_hf_state_dict(model: nn.Module, dequantize: bool = True,
                         dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """`dequantize=True`: dense weights in `dtype` (default: the model's compute dtype).
    `dequantize=False`: packed tensors in the checkpoint's format (compressed-tensors int4 `weight_packed` /
    `weight_scale` / `weight_shape`, fp8 `weight` / `weight_scale_inv`, ...; int4-tiled's in compressed-tensors'
    row-major layout)."""
    from ..quant.experts import QuantExperts
    from ..quant.linear import QuantLinear

    out: dict[str, Tensor] = {}
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    for path, module in model.named_modules():
        hp = _hf_path(path)
        if isinstance(module, QuantLinear):
            if dequantize:
                out[f"{hp}.weight"] = module.dequantize(dtype)
            else:
                out.update({f"{hp}.{k}": module.fmt.from_storage(k, v).clone() for k, v in module.packed().items()})
            if module.bias is not None:
                out[f"{hp}.bias"] = module.bias.to(dtype or module.bias.dtype)
        elif isinstance(module, QuantExperts):
            for proj in module.PROJECTIONS:
                device = next(iter(module.packed(proj).values())).device
                for e in range(module.num_experts):  # one expert at a time: the BF16 transient stays small
                    idx = torch.tensor([e], device=device)
                    if dequantize:
                        out[f"{hp}.{e}.{proj}.weight"] = module.dequantize(proj, idx, dtype)[0]
                    else:
                        out.update({f"{hp}.{e}.{proj}.{k}": module.fmt.from_storage(k, v[e]).clone()
                                    for k, v in module.packed(proj).items()})
        elif type(module) is Experts:
            for proj in module.PROJECTIONS:
                w = getattr(module, proj)
                for e in range(module.num_experts):
                    out[f"{hp}.{e}.{proj}.weight"] = w[e].to(dtype or w.dtype).clone()
        else:
            from .slots import AdapterLayer

            if isinstance(module, AdapterLayer):
                continue  # adapter tensors are not base weights
            for name, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
                if name in module._non_persistent_buffers_set:
                    continue
                if hp == "lm_head" and tied:
                    continue
                out[f"{hp}.{name}" if hp else name] = t.to(dtype) if dtype and t.is_floating_point() else t.clone()
    return out
