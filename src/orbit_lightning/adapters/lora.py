"""LoRA computed beside the frozen (possibly packed) base, never merged: y = base(x) + s · B(A(dropout(x)))."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..models import invariant
from ..models.moe import Experts, dispatch_experts
from ..quant.grouped import ExpertGroups, grouped_mm
from ..quant.linear import QuantLinear
from ..triton_kernels import kernels_module, kernels_run_on
from .slots import AdapterLayer, AdapterState


def lora_scale(r: int, alpha: float, rslora: bool) -> float:
    return alpha / math.sqrt(r) if rslora else alpha / r  # rsLoRA (arXiv:2312.03732) keeps updates rank-stable


def base_dtype(module: nn.Module) -> torch.dtype:
    dtype = getattr(module, "compute_dtype", None)
    if dtype is not None:
        return dtype
    for t in module.parameters():
        if t.is_floating_point():
            return t.dtype
    return torch.bfloat16


def base_device(module: nn.Module) -> torch.device:
    return next(iter(module.state_dict().values())).device


class LoraLinear(AdapterLayer):
    PARAMS = ("lora_A", "lora_B")

    def __init__(self, base_layer: nn.Module, state: AdapterState, r: int, alpha: float, rslora: bool = False,
                 dropout: float = 0.0, dtype: torch.dtype | None = None):
        super().__init__(base_layer, state)
        k, n = base_layer.in_features, base_layer.out_features
        dtype, device = dtype or base_dtype(base_layer), base_device(base_layer)
        self.lora_A = nn.Parameter(torch.empty(r, k, dtype=dtype, device=device))
        self.lora_B = nn.Parameter(torch.zeros(n, r, dtype=dtype, device=device))  # zero: starts as the base
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # PEFT's default init
        self.r, self.alpha, self.scaling = r, alpha, lora_scale(r, alpha, rslora)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.in_features, self.out_features = k, n

    def forward(self, x: Tensor) -> Tensor:
        base, t = self.base_layer, self.active_tensors()
        if t is not None and type(base) is QuantLinear and base.bias is None:
            delta = decode_delta([self], x, [t])
            if delta is not None:  # decode: the adapter rides in the base GEMV's launch
                return base.matmul(x, lora=delta)
        return self._add_delta(base(x), x, t)

    def add_delta(self, y: Tensor, x: Tensor) -> Tensor:
        """y (the base's output for x) plus the active adapter's s · B(A(dropout(x)))."""
        return self._add_delta(y, x, self.active_tensors())

    def _add_delta(self, y: Tensor, x: Tensor, t: dict[str, Tensor] | None) -> Tensor:
        if t is None:
            return y
        a, b = t["lora_A"], t["lora_B"]
        if _fused_decode(x, a, self.dropout):
            return kernels_module().lora_add(y, x, a, b, self.scaling)
        delta = F.linear(F.linear(self.dropout(x).to(a.dtype), a), b)
        return y + (delta * self.scaling).to(y.dtype)


def decode_delta(layers, x: Tensor, tensors: list[dict[str, Tensor] | None] | None = None):
    """The active adapters of `layers` (LoraLinears reading x, outputs side by side) as one `kernels.LoraDelta` for
    the decode kernels, which add them in the base matmul's launch; None unless every layer has an active adapter,
    all of one rank, that the decode kernels take (see `_fused_decode`). tensors: the layers' active tensors, where
    the caller has read them already."""
    if tensors is None:
        tensors = [m.active_tensors() if isinstance(m, LoraLinear) else None for m in layers]
    if any(t is None for t in tensors):
        return None
    a, b = [t["lora_A"] for t in tensors], [t["lora_B"] for t in tensors]
    if len({t.shape[0] for t in a}) != 1 or not all(_fused_decode(x, ag, m.dropout) for ag, m in zip(a, layers)):
        return None
    kernels = kernels_module()
    if len(layers) > kernels.lora.MAX_SEGMENTS:
        return None
    return kernels.LoraDelta(a, b, [m.scaling for m in layers])


def _fused_decode(x: Tensor, a: Tensor, dropout: nn.Module) -> bool:
    """Decode-sized inference on CUDA takes the one-launch LoRA kernel; training (autograd), batch-invariant
    mode (which routes the two F.linear calls to its fixed-tile kernel) and large batches keep torch's ops."""
    if not x.is_cuda or isinstance(dropout, nn.Dropout):
        return False
    if torch.is_grad_enabled() and (a.requires_grad or x.requires_grad):  # the kernel has no backward
        return False
    if x.numel() > 64 * x.shape[-1] or invariant.active():
        return False
    return kernels_run_on(x.device)


class LoraExperts(AdapterLayer):
    """Per-expert LoRA on routed experts: A [E, r, K], B [E, N, r] per projection, on the base's expert groups."""

    def __init__(self, base_layer: Experts, state: AdapterState, r: int, alpha: float, rslora: bool = False,
                 projections: tuple[str, ...] = Experts.PROJECTIONS, dtype: torch.dtype | None = None):
        super().__init__(base_layer, state)
        self.PARAMS = tuple(f"{p}_lora_{ab}" for p in projections for ab in "AB")
        self.projections = projections
        dtype, device = dtype or base_dtype(base_layer), base_device(base_layer)
        e = base_layer.num_experts
        for proj in projections:
            n, k = _expert_shape(base_layer, proj)
            a = torch.empty(e, r, k, dtype=dtype, device=device)
            for i in range(e):
                nn.init.kaiming_uniform_(a[i], a=math.sqrt(5))
            setattr(self, f"{proj}_lora_A", nn.Parameter(a))
            setattr(self, f"{proj}_lora_B", nn.Parameter(torch.zeros(e, n, r, dtype=dtype, device=device)))
        self.r, self.alpha, self.scaling = r, alpha, lora_scale(r, alpha, rslora)
        self.num_experts = e

    def chunk_size(self, rows: int, device: torch.device) -> int | None:
        return self.base_layer.chunk_size(rows, device)  # the LoRA follows the base's groups, device ones too

    def device_groups_blocker(self, device: torch.device, invariant: bool = False) -> str | None:
        return self.base_layer.device_groups_blocker(device, invariant)  # A/B: the plain grouped kernel

    def linear(self, proj: str, x: Tensor, groups: ExpertGroups) -> Tensor:
        t = self.active_tensors()
        if t is None or proj not in self.projections:
            return self.base_layer.linear(proj, x, groups)
        fused = self._decode_by_kernel(x, groups, (proj,), t)
        if fused is not None:
            return fused
        y = self.base_layer.linear(proj, x, groups)
        a, b = groups.select(t[f"{proj}_lora_A"]), groups.select(t[f"{proj}_lora_B"])
        delta = grouped_mm(grouped_mm(x.to(a.dtype), a, groups), b, groups)  # never syncs on device groups
        return y + (delta * self.scaling).to(y.dtype)

    def swiglu(self, x: Tensor, groups: ExpertGroups) -> Tensor:
        t = self.active_tensors()
        if t is None or not {"gate_proj", "up_proj"} & set(self.projections):
            return self.base_layer.swiglu(x, groups)  # (the base's fused decode kernel, where it has one)
        if {"gate_proj", "up_proj"} <= set(self.projections):
            fused = self._decode_by_kernel(x, groups, ("gate_proj", "up_proj"), t)
            if fused is not None:
                return fused
        return Experts.swiglu(self, x, groups)  # the two projections through this layer's `linear`

    def _decode_by_kernel(self, x: Tensor, groups: ExpertGroups, projs: tuple[str, ...], t: dict[str, Tensor]
                       ) -> Tensor | None:  # fmt: skip
        """The base's decode kernel (packed experts: one launch for A x, one for the projections with s B (A x) in
        their epilogue; SwiGLU's first half for gate and up) where it serves, else None."""
        fused, k = getattr(self.base_layer, "decode_by_kernel", None), kernels_module()
        a, b = tuple(t[f"{p}_lora_A"] for p in projs), tuple(t[f"{p}_lora_B"] for p in projs)
        if (fused is None or k is None or any(m.dtype != x.dtype for m in a + b)
                or torch.is_grad_enabled() and any(m.requires_grad for m in a + b)):  # (no backward for A, B)
            return None
        return fused(x, groups, None if len(projs) == 2 else projs[0], k.ExpertLora(a, b, self.scaling))

    def forward(self, x: Tensor, topk_ids: Tensor, topk_w: Tensor) -> Tensor:
        return dispatch_experts(x, topk_ids, topk_w, self)


def _expert_shape(experts: nn.Module, proj: str) -> tuple[int, int]:
    if hasattr(experts, "proj_shape"):
        return experts.proj_shape(proj)[1:]
    return tuple(getattr(experts, proj).shape[1:])
