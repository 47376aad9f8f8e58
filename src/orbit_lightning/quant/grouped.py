"""Grouped GEMM over contiguous row groups: y[rows of g] = x[rows of g] @ w[g]^T, and `ExpertGroups`, which says
how the rows split into groups.

Groups come in two kinds. *Device* groups are all E experts in order, empty ones included, described only by
int32 offsets on the device: building and using them needs no host sync, so they can be captured in a CUDA graph.
*Chunk* groups are a few active experts whose sizes the host read (the chunked MoE path).

torch's grouped GEMM (`torch.nn.functional.grouped_mm`, or `torch._grouped_mm` in older torch) reads the offsets on
the device; it runs where that is sync-free (bf16 on sm90 / sm100) and on the CPU where this torch has it (probed
once per dtype), for weights that need no gradient. Elsewhere: a per-group F.linear on host sizes, or, for device
groups on CUDA, each row reading its group's weight (a [M, N, K] transient: small weights such as expert LoRA).
In batch-invariant mode the kernels' plain grouped GEMM (`kernels.grouped_linear`: the fixed tile config the
dense path shares, device offsets, so also capturable) takes every call.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..triton_kernels import kernels_module

_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
PER_ROW_MAX_ELEMENTS = 1 << 25  # per-row weights gathered at most (e.g. decode rows x LoRA r x K)


@dataclass(frozen=True)
class ExpertGroups:
    """How the rows of one grouped call (sorted by group) split into G groups.

    offsets: int32 [G+1] on the rows' device; group g owns rows offsets[g]:offsets[g+1], offsets[G] = rows.
    ids: None for device groups (G = E, every expert in order); else int [G], the experts of a chunk.
    sizes: the G group sizes as host ints; chunk groups only.
    """

    offsets: Tensor
    ids: Tensor | None = None
    sizes: list[int] | None = None

    @classmethod
    def chunks(cls, counts: list[int], chunk: int, device: torch.device) -> list[tuple[int, int, ExpertGroups]]:
        """The active experts of per-expert row `counts`, `chunk` at a time: (first row, end row, groups) each,
        every chunk's offsets and ids uploaded in one copy."""
        active = [e for e, n in enumerate(counts) if n]
        runs = [active[i : i + chunk] for i in range(0, len(active), chunk)]
        if not runs:
            return []
        flat = [v for ids in runs for v in (0, *itertools.accumulate(counts[e] for e in ids), *ids)]
        table = torch.tensor(flat, dtype=torch.int32, pin_memory=device.type == "cuda").to(device, non_blocking=True)
        out, at, row = [], 0, 0
        for ids in runs:
            sizes = [counts[e] for e in ids]
            ends = at + len(ids) + 1
            out.append((row, row + sum(sizes), cls(table[at:ends], table[ends : ends + len(ids)], sizes)))
            at, row = at + 2 * len(ids) + 1, row + sum(sizes)
        return out

    @property
    def on_device(self) -> bool:
        return self.ids is None

    def select(self, stacked: Tensor) -> Tensor:
        """Per-expert tensors [E, ...] -> the groups' [G, ...] (the tensor itself for device groups)."""
        return stacked if self.ids is None else stacked[self.ids]

    def host_sizes(self) -> list[int]:
        """Group sizes on the host: a sync for device groups on CUDA."""
        return self.sizes if self.sizes is not None else self.offsets.diff().tolist()

    def row_groups(self, rows: int) -> Tensor:
        """[rows] the group of every row, computed on the device."""
        idx = torch.arange(rows, device=self.offsets.device, dtype=self.offsets.dtype)
        return torch.searchsorted(self.offsets[1:], idx, right=True)


@functools.cache
def _cpu_has_grouped_mm(dtype: torch.dtype) -> bool:
    try:
        _GROUPED_MM(
            torch.zeros(2, 8, dtype=dtype),
            torch.zeros(2, 8, 8, dtype=dtype).transpose(1, 2),
            offs=torch.tensor([1, 2], dtype=torch.int32),
        )
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def torch_grouped_mm_blocker(dtype: torch.dtype, dims: tuple[int, ...], device: torch.device) -> str | None:
    """Why torch's grouped GEMM cannot run sync-free on device offsets for operands of `dtype` whose matrix
    dims are `dims` on `device` (None: it can). Answered once per question: every grouped call asks, and reading
    the device's properties costs ~10 us of host time."""
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return _torch_grouped_mm_blocker(dtype, tuple(dims), device)


@functools.cache
def _torch_grouped_mm_blocker(dtype: torch.dtype, dims: tuple[int, ...], device: torch.device) -> str | None:
    if _GROUPED_MM is None:
        return f"torch {torch.__version__} has no grouped GEMM"
    if device.type == "cuda":
        if dtype != torch.bfloat16:
            return f"torch's grouped GEMM reads bf16 on CUDA, not {dtype}"
        if not torch.cuda.is_available():
            return "CUDA is not available"
        if torch.cuda.get_device_capability(device)[0] not in (9, 10):
            return "torch's grouped GEMM is sync-free on sm90 / sm100 only"
    elif device.type != "cpu" or not _cpu_has_grouped_mm(dtype):
        return f"this torch has no grouped GEMM for {dtype} on {device.type}"
    if any(d * dtype.itemsize % 16 for d in dims):
        return f"torch's grouped GEMM needs 16-byte rows; dims {dims} in {dtype} are not"
    return None


def _weight_grad(w: Tensor) -> bool:
    # torch's grouped GEMM computes dW as a 2-D x 2-D grouped GEMM, whose kernel asserts (on the device) that
    # every group but the last has a 16-byte multiple of rows; routing gives no such sizes.
    return torch.is_grad_enabled() and w.requires_grad


def _torch_ok(x: Tensor, w: Tensor) -> bool:
    if x.dtype != w.dtype or _weight_grad(w):
        return False
    return torch_grouped_mm_blocker(x.dtype, (x.shape[-1], w.shape[1]), x.device) is None


def _per_row_ok(x: Tensor, w: Tensor) -> bool:
    if _weight_grad(w):
        return False
    return x.shape[0] * w.shape[1] * w.shape[2] <= PER_ROW_MAX_ELEMENTS or torch.cuda.is_current_stream_capturing()


def _invariant_grouped(x: Tensor, w: Tensor, groups: ExpertGroups) -> Tensor:
    """The fixed-tile grouped kernel on the groups' offsets (no sync); backward through per-group matmuls."""
    from ..models import invariant

    kernels = kernels_module()

    def reference(x_: Tensor, w_: Tensor) -> Tensor:  # matmul, not F.linear, which the mode would re-route
        sizes = groups.host_sizes()
        return torch.cat([xg @ wg.t() for xg, wg, n in zip(x_.split(sizes), w_, sizes, strict=True) if n])

    return invariant.with_reference_grad(lambda x_, w_: kernels.grouped_linear(x_, groups.offsets, w_), reference,
                                         x, w)


def grouped_mm(x: Tensor, w: Tensor, groups: ExpertGroups) -> Tensor:
    """x [M, K] rows grouped contiguously as `groups` says, w [G, N, K] one weight per group -> [M, N].

    Batch-invariant mode: the kernels' fixed-tile grouped GEMM. Device groups on CUDA without torch's grouped
    GEMM: each row reads its group's weight while that transient is small (decode; always under CUDA-graph
    capture); otherwise, for weights that need a gradient, the host reads the group sizes (a sync; never under
    capture) and each group runs its own F.linear."""
    if x.shape[0] == 0:
        return x.new_zeros(0, w.shape[1])
    from ..models import invariant

    if invariant.use_kernels(x) and x.dtype == w.dtype:
        return _invariant_grouped(x, w, groups)
    if _torch_ok(x, w):
        return _GROUPED_MM(x, w.transpose(1, 2), offs=groups.offsets[1:])
    if groups.on_device and x.is_cuda and _per_row_ok(x, w):
        return per_row_mm(x, w, groups)
    sizes = groups.host_sizes()
    return torch.cat([F.linear(xg, wg) for xg, wg, n in zip(x.split(sizes), w, sizes, strict=True) if n])


def per_row_mm(x: Tensor, w: Tensor, groups: ExpertGroups) -> Tensor:
    """`grouped_mm` with each row reading its group's weight: no host sizes, but a [M, N, K] transient."""
    return torch.bmm(w[groups.row_groups(x.shape[0])], x[:, :, None])[:, :, 0]
