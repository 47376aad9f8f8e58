"""Linears that read the same input (q/k/v, gate/up) as one packed matrix at decode.

A decode GEMV has a fixed cost of a few microseconds (launch, one DRAM round trip, the split-K
reduction) on top of streaming its bytes, so q, k and v as three GEMVs pay it three times and one GEMV
over their stacked rows once (bench/RESULTS.md). `fuse_rows` re-seats the members' packed buffers as row
slices of one buffer per packed key: the old buffers are freed, so the base stays a single copy, and
every other path (training, prefill, checkpoint loading, which copies into the buffers) sees the same
values through the views. `project` then runs the group as one matmul where that pays and hands each
member its slice, with the member's bias and adapter added as its own forward would.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .linear import QuantLinear

# Batches up to the fused kernels' reach (dispatch.FUSED_MAX_ROWS: the decode GEMVs, kernels/wgmma_int4.py and
# lora_add_many) run as one matmul; larger ones per member. The bound was the GEMV's 16 rows until bench/rollout.py
# (H200, qwen3-8b with 8 layers, same run; bench/RESULTS.md, fourteenth session) measured 64 at 1.44 -> 1.37 /
# 1.87 -> 1.62 / 2.30 -> 1.99 ms per decode step at batch 16 / 32 / 64: one wgmma_int4 launch over the stacked rows
# fills the GPU where three narrow ones did not. `--fuse-16` there puts 16 back.
DECODE_ROWS = 64


class FusedRows:
    """Packed tensors of `members` stacked along N (views shared with the members) plus the group's shape."""

    def __init__(self, members: Sequence[QuantLinear], stacked: dict[str, Tensor]):
        first = members[0]
        self.members = tuple(members)
        self.fmt, self.in_features = first.fmt, first.in_features
        self.splits = [m.out_features for m in members]
        self.out_features = sum(self.splits)
        self.compute_dtype = first.compute_dtype
        shape = torch.tensor([self.out_features, self.in_features], dtype=torch.int64,
                             device=first.packed()["weight_shape"].device)
        self._packed = {**stacked, "weight_shape": shape}
        self._ptrs = [{k: getattr(m, k).data_ptr() for k in stacked} for m in members]

    def packed(self) -> dict[str, Tensor]:
        return self._packed

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        return self.fmt.dequantize(self.packed(), dtype or self.compute_dtype)

    def intact(self) -> bool:
        """Whether every member still reads the stacked buffers (a `.to()` or a reassigned buffer breaks it)."""
        return all(getattr(m, k).data_ptr() == p for m, ptrs in zip(self.members, self._ptrs) for k, p in ptrs.items())


@torch.no_grad()
def fuse_rows(layers: Sequence[nn.Module]) -> FusedRows | None:
    """Stack the packed rows of QuantLinears that share their input; None (nothing changed) unless they all
    are QuantLinears of one format, input size and device whose packed tensors are per-row (int4's words and
    group scales; not fp8's 128-row blocks nor nvfp4's per-matrix scale) apart from `weight_shape`."""
    if len(layers) < 2 or not all(type(m) is QuantLinear for m in layers):
        return None
    first, packs = layers[0], [m.packed() for m in layers]
    if "weight_shape" not in packs[0]:
        return None
    keys = [k for k in packs[0] if k != "weight_shape"]
    if not all(
        m.fmt.name == first.fmt.name and m.in_features == first.in_features
        and p["weight_shape"].device == packs[0]["weight_shape"].device
        and all(p[k].shape[0] == m.out_features for k in keys)
        for m, p in zip(layers, packs)
    ):
        return None
    stacked = {k: torch.cat([getattr(m, k) for m in layers]) for k in keys}
    row = 0
    for m in layers:
        for k in keys:
            m._buffers[k] = stacked[k][row : row + m.out_features]  # the old buffer is freed
        row += m.out_features
    group = FusedRows(layers, stacked)
    for m in layers:
        m.fused_rows = group
    return group


def fuse_projections(model: nn.Module) -> int:
    """Fuse every input-sharing group a module declares in `FUSED_INPUTS` (names of sibling linears, possibly
    wrapped by adapter layers). Returns how many groups were fused; idempotent."""
    fused = 0
    for module in model.modules():
        for names in getattr(module, "FUSED_INPUTS", ()):
            if not all(hasattr(module, n) for n in names):
                continue
            bases = [_base(getattr(module, n)) for n in names]
            group = getattr(bases[0], "fused_rows", None)
            if group is not None and group.intact() and group.members == tuple(bases):
                continue
            fused += fuse_rows(bases) is not None
    return fused


def _base(layer: nn.Module) -> nn.Module:
    return getattr(layer, "base_layer", layer)


def project(x: Tensor, layers: Sequence[nn.Module]) -> list[Tensor]:
    """[layer(x) for layer in layers], as one matmul over the stacked rows when the layers' bases are one intact
    fused group, the batch is decode-sized, no autograd graph is needed (the fused matmul has no backward) and
    batch-invariant mode is off (it keeps the trainer's per-layer calls). Each member's bias and LoRA delta are
    added to its own slice as its forward adds them (at decode, every member's adapter in the GEMV's own launch,
    as each member's own call would run it)."""
    from ..adapters.lora import LoraLinear, decode_delta  # (lazy: models import this module, adapters import models)
    from ..models import invariant

    group = getattr(_base(layers[0]), "fused_rows", None)
    rows = x.numel() // max(x.shape[-1], 1)
    if (
        group is None
        or rows > DECODE_ROWS
        or (torch.is_grad_enabled() and x.requires_grad)
        or invariant.active()
        or tuple(_base(m) for m in layers) != group.members
        or not all(type(m) in (QuantLinear, LoraLinear) for m in layers)
        or not group.intact()
    ):
        return [layer(x) for layer in layers]
    from .dispatch import dequant_matmul

    if all(m.bias is None for m in group.members):
        delta = decode_delta(layers, x)  # every member's adapter, added in the GEMV's own launch
        if delta is not None:
            return list(dequant_matmul(x, group, delta).split(group.splits, dim=-1))
    y = dequant_matmul(x, group)
    outs = []
    for layer, part in zip(layers, y.split(group.splits, dim=-1)):
        base = _base(layer)
        if base.bias is not None:
            part = part + base.bias.to(part.dtype)
        outs.append(layer.add_delta(part, x) if layer is not base else part)
    return outs
