"""Where a packed matmul runs.

On CUDA, with the Triton kernels (`orbit_lightning.kernels`) supporting the format:
- few rows (decode, M <= FUSED_MAX_ROWS) or batch-invariant mode: the fused dequant-GEMM, which reads only the
  packed bytes and never writes a BF16 weight;
- more rows, up to the warpgroup-MMA kernels' reach (int4 on Hopper: the rollout's large decode batches, short
  prefills; MoE chunks of a few hundred rows per expert): those kernels, which also read only the packed bytes;
- many rows (prefill, training): the kernels' dequantizer writes the weight (or the chunk of experts) once in
  BF16, cuBLAS / grouped GEMM runs, and the tile is freed. On the H200 this beat the fused tile kernel from M ~ 128
  (bench/RESULTS.md); the transient is one weight or one expert chunk, as the design bounds it.
Elsewhere (CPU): the pure-torch reference dequantizer, then matmul.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..triton_kernels import kernels_module
from .grouped import ExpertGroups, grouped_mm

FUSED_MAX_ROWS = 64


def _cuda_kernels(x: Tensor, fmt):
    """The kernels when they take x: on CUDA, or wherever they run (Triton's interpreter on the CPU) in
    batch-invariant mode, which must not fall back to a matmul that picks its reduction order by shape."""
    k = kernels_module()
    if k is None or not k.kernels_available(x.device) or not k.supports(fmt):
        return None
    return k if x.is_cuda or k.is_batch_invariant() else None


def _fused(k, rows: int) -> bool:
    return rows <= FUSED_MAX_ROWS or k.is_batch_invariant()


def fused_grouped_blocker(fmt, device: torch.device) -> str | None:
    """Why the fused grouped kernel cannot run experts packed in `fmt` on `device` (None: it can)."""
    k = kernels_module()
    if k is not None and not k.supports(fmt):
        return f"the Triton kernels do not read format {fmt.name}"
    if device.type != "cuda":
        return f"the fused grouped kernel runs on CUDA, not {device.type}"
    if k is None:
        return "the Triton kernels (orbit_lightning.kernels) cannot be imported"
    if not k.kernels_available(device):
        return f"the Triton kernels cannot run on {device} (they need compute capability >= 8.0)"
    return None


def fused_grouped(fmt, rows: int, num_experts: int, device: torch.device) -> bool:
    """MoE: run all experts in one fused grouped launch on device offsets (no host sync, nothing materialized)?
    It wins while experts see few rows each (decode: <= FUSED_MAX_ROWS per expert on average over all
    `num_experts`, known without reading the routing), is the batch-invariant path, and is taken under CUDA-graph
    capture, which the chunked path (host-read sizes) cannot enter. Large batches: chunked dequant + grouped GEMM."""
    k = kernels_module()
    if fused_grouped_blocker(fmt, device) is not None:  # batch-invariant mode: wherever the kernels run (CPU too)
        return k is not None and k.is_batch_invariant() and k.supports(fmt) and k.kernels_available(device)
    capturing = torch.cuda.is_current_stream_capturing()
    return rows <= FUSED_MAX_ROWS * max(num_experts, 1) or k.is_batch_invariant() or capturing


def _dense_weight(layer, dtype: torch.dtype, k) -> Tensor:
    return k.dequantize(layer.fmt, layer.packed(), dtype) if k is not None else layer.dequantize(dtype)


def dequant_matmul(x: Tensor, layer, lora=None) -> Tensor:
    """x [..., K] @ W^T -> [..., N] for a QuantLinear (or fused group) `layer`; plus the adapters `lora` (a
    kernels.LoraDelta, which adapters.lora.decode_delta gives only for decode batches the kernels run)."""
    x2 = x.reshape(-1, x.shape[-1])
    k = _cuda_kernels(x2, layer.fmt)
    if k is not None and _fused(k, x2.shape[0]):
        y = k.dequant_linear(x2, layer.fmt, layer.packed(), lora=lora)
    else:
        if lora is not None:
            raise ValueError(f"LoRA deltas ride only in the decode kernels' matmul, not with {x2.shape[0]} rows "
                             f"on {x.device}")  # fmt: skip
        y = k.prefill_linear(x2, layer.fmt, layer.packed()) if k is not None else None  # (k here: CUDA only)
        if y is None:
            y = x2 @ _dense_weight(layer, x.dtype, k).t()
    return y.view(*x.shape[:-1], layer.out_features)


def dequant_matmul_dx(dy: Tensor, layer) -> Tensor:
    """dX = dY @ W: [..., N] -> [..., K], reading the same packed weight (no dW, no saved weight)."""
    dy2 = dy.reshape(-1, dy.shape[-1])
    k = _cuda_kernels(dy2, layer.fmt)
    if k is not None and _fused(k, dy2.shape[0]):
        dx = k.dequant_linear_dx(dy2, layer.fmt, layer.packed())
    else:
        dx = dy2 @ _dense_weight(layer, dy.dtype, k)
    return dx.view(*dy.shape[:-1], layer.in_features)


def _chunk_weights(experts, proj: str, expert_ids: Tensor | None, dtype: torch.dtype, k) -> Tensor:
    if k is None:
        return experts.dequantize(proj, expert_ids, dtype)  # [c, N, K]
    return k.dequantize(experts.fmt, experts.packed(proj), dtype, expert_ids=expert_ids)


def _grouped_kernels(x: Tensor, groups: ExpertGroups, fmt):
    """The kernels, for device groups they can run (CUDA; on the CPU only under Triton's interpreter)."""
    if not groups.on_device:
        return None
    k = kernels_module()
    return k if k is not None and k.kernels_available(x.device) and k.supports(fmt) else None


def dequant_grouped(x: Tensor, experts, proj: str, groups: ExpertGroups) -> Tensor:
    """Rows of x grouped by expert -> x_g @ W[e_g]^T. Device groups: the fused kernel reads the packed bytes of
    the experts with rows, on device offsets. Chunk groups: the grouped warpgroup-MMA kernel where it serves (int4
    on Hopper, a few hundred rows per expert: `kernels.grouped_prefill_linear`), else the chunk's experts are
    dequantized, then grouped GEMM. (Device groups without the kernels dequantize every expert: correct, but
    unbounded memory.)"""
    k = _grouped_kernels(x, groups, experts.fmt)
    if k is not None:
        return k.grouped_dequant_linear(x, groups.offsets, experts.fmt, experts.packed(proj))
    cuda = _cuda_kernels(x, experts.fmt)
    if cuda is not None and x.is_cuda:
        y = cuda.grouped_prefill_linear(x, groups.offsets, experts.fmt, experts.packed(proj), expert_ids=groups.ids)
        if y is not None:
            return y
    w = _chunk_weights(experts, proj, groups.ids, x.dtype, cuda)
    return grouped_mm(x, w, groups)


def decode_by_kernel(x: Tensor, experts, groups: ExpertGroups, proj: str | None = None, lora=None) -> Tensor | None:
    """Rows of x grouped by expert through the decode kernel where it serves (device groups of a few rows per expert),
    else None: proj None: SwiGLU's first half, silu(x_g @ Gate[e_g]^T) * (x_g @ Up[e_g]^T), in one launch; else that
    projection. lora (kernels.ExpertLora, gate then up for SwiGLU): the projections' expert LoRA, added in the
    kernel's epilogue after one more launch for A x. No autograd."""
    k = _grouped_kernels(x, groups, experts.fmt)
    if k is None:
        return None
    if proj is None:
        return k.grouped_dequant_swiglu(x, groups.offsets, experts.fmt, experts.packed("gate_proj"),
                                        experts.packed("up_proj"), lora=lora)  # fmt: skip
    if lora is None:
        return None  # (one projection alone: dequant_grouped takes the same kernel)
    return k.grouped_dequant_lora(x, groups.offsets, experts.fmt, experts.packed(proj), lora)


def dequant_grouped_dx(dy: Tensor, experts, proj: str, groups: ExpertGroups) -> Tensor:
    """dequant_grouped's dX, dy_g @ W[e_g], by the same choice of path."""
    k = _grouped_kernels(dy, groups, experts.fmt)
    if k is not None:
        return k.grouped_dequant_linear_dx(dy, groups.offsets, experts.fmt, experts.packed(proj))
    cuda = _cuda_kernels(dy, experts.fmt)
    if cuda is not None and dy.is_cuda:
        dx = cuda.grouped_prefill_linear(dy, groups.offsets, experts.fmt, experts.packed(proj), expert_ids=groups.ids,
                                         dx=True)
        if dx is not None:
            return dx
    w = _chunk_weights(experts, proj, groups.ids, dy.dtype, cuda)
    return grouped_mm(dy, w.transpose(1, 2), groups)
