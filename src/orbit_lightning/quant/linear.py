"""A frozen linear layer whose weight stays packed; forward dequantizes transiently, backward computes dX only."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .formats import QuantFormat, get_format
from .packed import packed_tensors, register_packed, store_packed


class _FrozenLinearFn(torch.autograd.Function):
    """y = x @ W^T with W packed. Saves nothing for W: backward dequantizes again and returns dX = dY @ W only,
    so no weight gradient is computed or allocated and no BF16 copy of W outlives the op."""

    @staticmethod
    def forward(ctx, x: Tensor, layer: QuantLinear) -> Tensor:
        ctx.layer = layer
        return layer.matmul(x)

    @staticmethod
    def backward(ctx, dy: Tensor):
        return ctx.layer.matmul_dx(dy), None


class QuantLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, fmt: QuantFormat | str, bias: bool = False,
                 dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.fmt = (get_format(fmt) if isinstance(fmt, str) else fmt).for_shape(self.shape)
        self.compute_dtype = dtype  # dtype of the transient dequantized tiles and of activations
        register_packed(self, self.fmt, self.shape)
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype) if bias else None)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def packed(self) -> dict[str, Tensor]:
        return packed_tensors(self, self.fmt, self.shape)

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        return self.fmt.dequantize(self.packed(), dtype or self.compute_dtype)

    def matmul(self, x: Tensor, lora=None) -> Tensor:
        """x @ W^T (no bias), plus the decode adapters `lora` (a kernels.LoraDelta) in the same launch."""
        from .dispatch import dequant_matmul

        return dequant_matmul(x, self, lora)

    def matmul_dx(self, dy: Tensor) -> Tensor:
        from .dispatch import dequant_matmul_dx

        return dequant_matmul_dx(dy, self)

    def forward(self, x: Tensor) -> Tensor:
        y = _FrozenLinearFn.apply(x, self) if torch.is_grad_enabled() and x.requires_grad else self.matmul(x)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: QuantFormat | str) -> QuantLinear:
        w = linear.weight
        q = cls(linear.in_features, linear.out_features, fmt, bias=linear.bias is not None,
                dtype=w.dtype if w.is_floating_point() else torch.bfloat16)
        q.to(w.device)
        if w.device.type != "meta":
            q.load_checkpoint_tensor("weight", w.detach(), None, "weight")
            if linear.bias is not None:
                q.bias.copy_(linear.bias.detach())
        return q

    # ---- checkpoint loading (see models.loader) ----------------------------------------------------

    def load_checkpoint_tensor(self, local: str, tensor: Tensor, expert: int | None, key: str) -> None:
        if local == "weight":
            if tuple(tensor.shape) != self.shape:
                raise ValueError(f"{key}: checkpoint shape {tuple(tensor.shape)} != model shape {self.shape}")
            store_packed(self, self.fmt.quantize(tensor.to(self.weight_device_for_quant())), key_for_errors=key)
        elif local == "bias" and self.bias is not None:
            with torch.no_grad():
                self.bias.copy_(tensor)
        else:
            store_packed(self, {local: self.fmt.to_storage(local, tensor)}, key_for_errors=key)

    def weight_device_for_quant(self) -> torch.device:
        # Quantize on the layer's device (GPU when loading to GPU): one tensor at a time, then freed.
        return next(iter(self.packed().values())).device

    def canonical_checkpoint_name(self, local: str) -> str:
        return "weight" if local in self.fmt.packed_shapes(self.shape) else local

    def expected_checkpoint_tensors(self) -> set[tuple[str, int | None]]:
        return {("weight", None)} | ({("bias", None)} if self.bias is not None else set())

    @torch.no_grad()
    def random_init(self, generator: torch.Generator) -> None:
        store_packed(self, self.fmt.random_packed(self.shape, device=self.bias.device if self.bias is not None
                                                  else self.weight_device_for_quant(), generator=generator))
        if self.bias is not None:
            self.bias.zero_()

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, format={self.fmt.name}"
