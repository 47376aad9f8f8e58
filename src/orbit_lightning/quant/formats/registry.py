"""The `QuantFormat` interface and the name -> format registry.

A weight is `w: [..., N, K]` (N = out features, K = in features = the reduction dim); leading dims are
stacked experts `[E, N, K]`. Every format quantizes along K and returns a dict of packed tensors.

Contract shared by all formats (the Triton kernels rely on it):
- Every packed tensor, including per-matrix scalars such as nvfp4's global scale, keeps the leading `...`
  dims of the weight as its own leading dims. So `index_leading(packed, idx)` (indexing every key with the
  same `idx`) selects experts: `fmt.dequantize(index_leading(packed, idx)) == fmt.dequantize(packed)[idx]`.
- Packed tensors are contiguous, in the dtypes listed by `packed_shapes`.
- `dequantize` computes in float32 (float64 when `dtype=torch.float64`) and casts once at the end.
- `quantize` computes in float32 (float64 for float64 input), so a weight dequantized in float64 re-quantizes
  to the same bits wherever the format allows it (see each format's notes).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
from torch import Tensor

PackedShapes = dict[str, tuple[tuple[int, ...], torch.dtype]]


class QuantFormat(ABC):
    """A configured packed low-precision weight format (e.g. int4 with group size 64)."""

    name: str  # registry key that `get_format` maps back to this configuration

    @abstractmethod
    def packed_shapes(self, shape: tuple[int, ...]) -> PackedShapes:
        """Key -> (shape, dtype) of each packed tensor for a weight of `shape` [..., N, K]."""

    @abstractmethod
    def quantize(self, w: Tensor) -> dict[str, Tensor]:
        """w: [..., N, K] any float dtype -> packed tensors (see `packed_shapes`)."""

    @abstractmethod
    def dequantize(self, packed: dict[str, Tensor], dtype: torch.dtype = torch.bfloat16) -> Tensor:
        """Packed tensors -> [..., N, K] in `dtype`."""

    @abstractmethod
    def random_packed(
        self,
        shape: tuple[int, ...],
        device: torch.device | str = "cpu",
        generator: torch.Generator | None = None,
    ) -> dict[str, Tensor]:
        """Valid packed tensors drawn directly in packed form; dequantized std is about 0.02."""

    def validate(self, shape: tuple[int, ...]) -> None:
        """Raise ValueError if a weight of `shape` cannot use this format. Subclasses add K constraints."""
        shape = tuple(shape)
        if len(shape) < 2 or any(d <= 0 for d in shape):
            raise ValueError(
                f"{self.name}: a weight must have shape [..., N, K] with positive sizes, got {shape}"
            )

    def for_shape(self, shape: tuple[int, ...]) -> QuantFormat:
        """The format a weight of `shape` is stored in: itself, or for a storage layout the shape cannot take (int4's
        tiled layout), the same values in the format's plain layout."""
        return self

    def same_values(self, other: QuantFormat) -> bool:
        """Whether `other` packs the same values as this format, perhaps laid out apart (int4 and int4-tiled)."""
        return self == other

    def to_storage(self, key: str, tensor: Tensor) -> Tensor:
        """Packed tensor `key` as a checkpoint holds it (compressed-tensors' row-major layout) -> as this format
        stores it (the same tensor but for int4's tiled layout)."""
        return tensor

    def from_storage(self, key: str, tensor: Tensor) -> Tensor:
        """to_storage's inverse: a stored packed tensor as a checkpoint holds it."""
        return tensor

    def nbytes(self, shape: tuple[int, ...]) -> int:
        """Storage of the packed form of a weight of `shape`, in bytes."""
        shapes = self.packed_shapes(shape).values()
        return sum(math.prod(s) * torch.empty((), dtype=dt).element_size() for s, dt in shapes)

    def empty_packed(self, shape: tuple[int, ...], device: torch.device | str = "meta") -> dict[str, Tensor]:
        """Uninitialised packed buffers (meta by default), e.g. to build a module before loading weights."""
        shapes = self.packed_shapes(shape)
        return {k: torch.empty(s, dtype=dt, device=device) for k, (s, dt) in shapes.items()}

    def _check_input(self, w: Tensor) -> None:
        if not w.is_floating_point():
            raise TypeError(f"{self.name}: quantize expects a floating-point weight, got {w.dtype}")
        self.validate(tuple(w.shape))
        if not bool(torch.isfinite(w).all()):
            raise ValueError(f"{self.name}: the weight contains NaN or inf; fix it before quantizing")

    def _check_packed(self, packed: dict[str, Tensor], keys: tuple[str, ...]) -> None:
        missing = [k for k in keys if k not in packed]
        if missing:
            raise KeyError(f"{self.name}: packed weight is missing {missing}; expected keys {list(keys)}")


FORMATS: dict[str, Callable[[], QuantFormat]] = {}


def register_format(name: str) -> Callable:
    """Decorator: register a zero-argument factory (usually the format class) under `name`."""

    def decorator(factory: Callable[[], QuantFormat]) -> Callable[[], QuantFormat]:
        if name in FORMATS:
            raise ValueError(f"quant format {name!r} is already registered")
        FORMATS[name] = factory
        return factory

    return decorator


def get_format(spec: str | QuantFormat) -> QuantFormat:
    """Parse a user string such as "int4", "int4-g128", "fp8", "mxfp4", "nvfp4" or "nf4"."""
    if isinstance(spec, QuantFormat):
        return spec
    if not isinstance(spec, str) or spec not in FORMATS:
        raise ValueError(f"unknown quant format {spec!r}; valid names: {', '.join(sorted(FORMATS))}")
    return FORMATS[spec]()


def index_leading(packed: dict[str, Tensor], idx) -> dict[str, Tensor]:
    """Select along the leading (expert) dims of every packed tensor, e.g. `idx = 3` or `idx = expert_ids`."""
    return {k: v[idx] for k, v in packed.items()}


def float_compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64 (exact reference paths); everything else computes in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32
