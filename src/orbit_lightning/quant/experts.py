"""Routed experts on a packed base. Device groups (decode, batch-invariant mode, CUDA-graph capture): the fused
grouped kernel reads the packed bytes of every expert with rows, on device offsets. Chunk groups (large batches):
only the chunk's experts are dequantized, one projection at a time, and freed before the next. Backward reads
the packed weights again the same way and returns dX only."""

from __future__ import annotations

import torch
from torch import Tensor

from ..models.moe import Experts
from .formats import QuantFormat, get_format
from .grouped import ExpertGroups
from .packed import packed_tensors, register_packed, store_packed


class _FrozenGroupedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, experts: QuantExperts, proj: str, groups: ExpertGroups) -> Tensor:
        from .dispatch import dequant_grouped

        ctx.experts, ctx.proj, ctx.groups = experts, proj, groups
        return dequant_grouped(x, experts, proj, groups)

    @staticmethod
    def backward(ctx, dy: Tensor):
        from .dispatch import dequant_grouped_dx

        return dequant_grouped_dx(dy, ctx.experts, ctx.proj, ctx.groups), None, None, None


class QuantExperts(Experts):
    """Same dispatch loop as `Experts`; the stacked weights are packed buffers `{proj}.weight_packed` etc."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        fmt: QuantFormat | str,
        dtype: torch.dtype = torch.bfloat16,
    ):
        torch.nn.Module.__init__(self)
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.fmt = get_format(fmt) if isinstance(fmt, str) else fmt
        for proj in self.PROJECTIONS:  # one storage layout all three projections take
            self.fmt = self.fmt.for_shape(self.proj_shape(proj))
        self.compute_dtype = dtype
        for proj in self.PROJECTIONS:
            register_packed(self, self.fmt, self.proj_shape(proj), prefix=f"{proj}_")

    @property
    def transient_dtype(self) -> torch.dtype:
        return self.compute_dtype

    def proj_shape(self, proj: str) -> tuple[int, int, int]:
        e, d, i = self.num_experts, self.hidden, self.intermediate
        return (e, d, i) if proj == "down_proj" else (e, i, d)

    def packed(self, proj: str) -> dict[str, Tensor]:
        return packed_tensors(self, self.fmt, self.proj_shape(proj), prefix=f"{proj}_")

    def dequantize(self, proj: str, expert_ids: Tensor | None = None, dtype: torch.dtype | None = None) -> Tensor:
        packed = self.packed(proj)
        if expert_ids is not None:
            packed = {k: v[expert_ids] for k, v in packed.items()}
        return self.fmt.dequantize(packed, dtype or self.compute_dtype)

    def chunk_size(self, rows: int, device: torch.device) -> int | None:
        """Device groups (None) while the fused grouped kernel applies, else `experts_per_chunk()` experts per
        dequantized grouped GEMM, which bounds the transient weights (in compute_dtype)."""
        from .dispatch import fused_grouped

        return None if fused_grouped(self.fmt, rows, self.num_experts, device) else self.experts_per_chunk()

    def device_groups_blocker(self, device: torch.device, invariant: bool = False) -> str | None:
        from .dispatch import fused_grouped_blocker

        return fused_grouped_blocker(self.fmt, device)  # the fused kernel has a batch-invariant mode

    def linear(self, proj: str, x: Tensor, groups: ExpertGroups) -> Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            return _FrozenGroupedFn.apply(x, self, proj, groups)
        from .dispatch import dequant_grouped

        return dequant_grouped(x, self, proj, groups)

    def swiglu(self, x: Tensor, groups: ExpertGroups) -> Tensor:
        h = self.decode_by_kernel(x, groups)
        return h if h is not None else super().swiglu(x, groups)

    def decode_by_kernel(self, x: Tensor, groups: ExpertGroups, proj: str | None = None, lora=None) -> Tensor | None:
        """quant.dispatch.decode_by_kernel (SwiGLU's first half for proj None, or `proj`, with `lora`'s expert LoRA)
        where it serves and no autograd graph is needed (the kernel has no backward); None elsewhere."""
        if torch.is_grad_enabled() and x.requires_grad:
            return None
        from .dispatch import decode_by_kernel

        return decode_by_kernel(x, self, groups, proj, lora)

    @classmethod
    def from_experts(cls, experts: Experts, fmt: QuantFormat | str) -> QuantExperts:
        e, i, d = experts.gate_proj.shape
        dtype = experts.gate_proj.dtype
        q = cls(e, d, i, fmt, dtype=dtype).to(experts.gate_proj.device)
        q.chunk, q.chunk_mib = experts.chunk, experts.chunk_mib
        if experts.gate_proj.device.type != "meta":
            for proj in cls.PROJECTIONS:
                w = getattr(experts, proj).detach()
                for idx in range(e):  # one expert at a time keeps the transient small
                    store_packed(q, q.fmt.quantize(w[idx]), prefix=f"{proj}_", index=idx)
        return q

    # ---- checkpoint loading (see models.loader) ----------------------------------------------------

    def load_checkpoint_tensor(self, local: str, tensor: Tensor, expert: int | None, key: str) -> None:
        proj, _, suffix = local.partition(".")
        if proj not in self.PROJECTIONS or expert is None:
            raise ValueError(f"{key}: unexpected tensor for quantized experts")
        if suffix == "weight":
            want = self.proj_shape(proj)[1:]
            if tuple(tensor.shape) != want:
                raise ValueError(f"{key}: checkpoint shape {tuple(tensor.shape)} != model shape {want}")
            device = getattr(self, f"{proj}_{next(iter(self.fmt.packed_shapes(want)))}").device
            store_packed(
                self, self.fmt.quantize(tensor.to(device)), prefix=f"{proj}_", index=expert, key_for_errors=key
            )
        else:
            store_packed(self, {suffix: self.fmt.to_storage(suffix, tensor)}, prefix=f"{proj}_", index=expert,
                         key_for_errors=key)

    def canonical_checkpoint_name(self, local: str) -> str:
        proj, _, _ = local.partition(".")
        return f"{proj}.weight"

    def expected_checkpoint_tensors(self) -> set[tuple[str, int | None]]:
        return {(f"{p}.weight", e) for p in self.PROJECTIONS for e in range(self.num_experts)}

    @torch.no_grad()
    def random_init(self, generator: torch.Generator) -> None:
        for proj in self.PROJECTIONS:
            device = next(iter(self.packed(proj).values())).device
            store_packed(
                self,
                self.fmt.random_packed(self.proj_shape(proj), device=device, generator=generator),
                prefix=f"{proj}_",
            )

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, hidden={self.hidden}, inter={self.intermediate}, format={self.fmt.name}"
