"""Public entry points: plain torch functions (no autograd; the quant module wraps them).

Weights are mappings of tensor name -> tensor in the layouts of `formats.py`. `fmt` is a format name
of the quant registry ("int4", "int4-g128", "fp8", "mxfp4", "nvfp4") or a QuantFormat object;
`fmt_kw` carries the format's options (only int4 has one: group_size, default 32).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from . import configs, wgmma_int4, wgmma_int4_dx
from .configs import GemvConfig, TileConfig, capability, pick_grouped_mma
from .emulate import INTERPRETED
from .formats import PackedWeight, plain, resolve
from .gemm import dense_gemm, fast_int4, wgmma_serves
from .gemv_lora import LoraDelta
from .grouped import check_grouped, grouped_gemm
from .grouped_lora import ExpertLora
from .grouped_mma import grouped_mma, same_layout
from .mode import is_batch_invariant

if TYPE_CHECKING:  # the quant package imports these kernels, not the other way round
    from orbit_lightning.quant.formats import QuantFormat

def kernels_available(device: torch.device | str) -> bool:
    """True when these kernels can run on `device`: a CUDA GPU of compute capability >= 8.0 (bf16
    tensor cores), or the CPU when Triton's interpreter was enabled before this package was imported."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and capability(device) >= (8, 0)
    return device.type == "cpu" and INTERPRETED


def dequant_linear(x: Tensor, fmt: str | QuantFormat, packed: Mapping[str, Tensor], *,
                   config: TileConfig | None = None, lora: LoraDelta | None = None, **fmt_kw) -> Tensor:
    """y = x @ W^T with W [N, K] decoded in-kernel. x: [..., K] bf16/fp16/fp32 -> y [..., N] in x.dtype.
    lora: adapters whose deltas s_g B_g (A_g x) are added on their columns (decode batches, <= lora.MAX_ROWS rows:
    in the GEMV's launch where they fit, else by `lora_add_many`)."""
    return dense_gemm(x, resolve(fmt, packed, stacked=False, **fmt_kw), dx=False, config=config, lora=lora)


def prefill_linear(x: Tensor, fmt: str | QuantFormat, packed: Mapping[str, Tensor], **fmt_kw) -> Tensor | None:
    """dequant_linear for more rows than the decode batches (quant.dispatch.FUSED_MAX_ROWS): the rollout's large
    decode batches and short prefills, where the warpgroup-MMA kernel serves (int4 on bf16, Hopper, up to
    wgmma_int4.MAX_ROWS rows, where it measured faster than dequantizing for cuBLAS; outside batch-invariant mode),
    reading only the packed bytes; None elsewhere, for the caller's path. x: [..., K] -> [..., N]."""
    w = resolve(fmt, packed, stacked=False, **fmt_kw)
    x2 = x.reshape(-1, x.shape[-1])
    if not wgmma_serves(x2, w):
        return None
    return dense_gemm(x, w, dx=False)


def dequant_linear_dx(dy: Tensor, fmt: str | QuantFormat, packed: Mapping[str, Tensor], *,
                      config: TileConfig | None = None, **fmt_kw) -> Tensor:
    """dx = dy @ W (gradient w.r.t. the input only). dy: [..., N] -> dx [..., K] in dy.dtype."""
    return dense_gemm(dy, resolve(fmt, packed, stacked=False, **fmt_kw), dx=True, config=config)


def linear(x: Tensor, weight: Tensor, *, config: TileConfig | None = None) -> Tensor:
    """y = x @ weight^T for an unquantized weight [N, K] through the same tile loop as the packed formats
    (what batch-invariant mode needs for adapters, lm_head and routers). x: [..., K] -> [..., N]."""
    return dense_gemm(x, plain(weight, stacked=False), dx=False, config=config)


def grouped_linear(x_sorted: Tensor, expert_offsets: Tensor, weight: Tensor, *,
                   config: TileConfig | None = None) -> Tensor:
    """grouped_dequant_linear for unquantized stacked weights [E, N, K]: y[rows_e] = x[rows_e] @ W_e^T."""
    return grouped_gemm(x_sorted, expert_offsets, plain(weight, stacked=True), dx=False, config=config)


def int4_linear(x: Tensor, packed: Mapping[str, Tensor], group_size: int = 32, *,
                config: TileConfig | None = None) -> Tensor:
    """dequant_linear for the int4 pack-quantized format. x: [..., K] -> [..., N]."""
    return dequant_linear(x, "int4", packed, config=config, group_size=group_size)


def int4_linear_dx(dy: Tensor, packed: Mapping[str, Tensor], group_size: int = 32, *,
                   config: TileConfig | None = None) -> Tensor:
    """dequant_linear_dx for the int4 pack-quantized format. dy: [..., N] -> [..., K]."""
    return dequant_linear_dx(dy, "int4", packed, config=config, group_size=group_size)


def grouped_dequant_linear(x_sorted: Tensor, expert_offsets: Tensor, fmt: str | QuantFormat,
                           packed: Mapping[str, Tensor], *, config: TileConfig | None = None,
                           **fmt_kw) -> Tensor:
    """MoE forward over active experts: y[rows_e] = x_sorted[rows_e] @ W_e^T.

    x_sorted: [T, K] rows sorted by expert; expert_offsets: int [E+1], rows of expert e are
    expert_offsets[e]:expert_offsets[e+1] (offsets[0] = 0, offsets[E] = T); packed: stacked [E, ...]
    tensors. Returns [T, N] in x_sorted.dtype. Decode batches (a few rows per expert) of int4 on bf16 take the
    mma kernel (grouped_mma.py) unless `config` asks for the tile kernel.
    """
    w = resolve(fmt, packed, stacked=True, **fmt_kw)
    mma = _decode_config(x_sorted, w) if config is None else None
    if mma is None:
        return grouped_gemm(x_sorted, expert_offsets, w, dx=False, config=config)  # (checks its arguments)
    check_grouped(x_sorted, expert_offsets, w, dx=False)
    return grouped_mma(x_sorted, expert_offsets, w, mma)


def grouped_prefill_linear(x_sorted: Tensor, group_offsets: Tensor, fmt: str | QuantFormat,
                           packed: Mapping[str, Tensor], expert_ids: Tensor | None = None, dx: bool = False,
                           **fmt_kw) -> Tensor | None:
    """grouped_dequant_linear (or, dx=True, grouped_dequant_linear_dx: x_sorted is then dy [T, N]) for many rows per
    expert (prefill, training) where the grouped warpgroup-MMA kernels serve (int4 g32 on bf16, Hopper, at most
    configs.WGMMA_GROUPED_MAX_ROWS rows per group on average, WGMMA_GROUPED_DX_MAX_ROWS for dX, where they measured
    faster than dequantizing for torch's grouped GEMM; outside batch-invariant mode), reading only the packed
    bytes; None elsewhere, for the caller's path. group_offsets: int32 [G + 1] on the device; expert_ids: int32 [G],
    the experts of the groups (a chunk of experts), or None for G = E. Returns [T, N] (dX: [T, K]) in x_sorted.dtype."""
    w = resolve(fmt, packed, stacked=True, **fmt_kw)
    groups = w.experts if expert_ids is None else expert_ids.numel()
    supported = wgmma_int4_dx.supports_dx(x_sorted, w) if dx else wgmma_int4.supports_grouped(x_sorted, w)
    max_rows = configs.WGMMA_GROUPED_DX_MAX_ROWS if dx else configs.WGMMA_GROUPED_MAX_ROWS
    if (not configs.WGMMA_INT4 or is_batch_invariant() or not supported or group_offsets.dtype != torch.int32
            or x_sorted.shape[0] > max_rows * groups):
        return None
    if x_sorted.shape[1] != (w.n if dx else w.k):
        raise ValueError(f"{'dy' if dx else 'x'}_sorted has {x_sorted.shape[1]} features; the experts' weights "
                         f"[{w.n}, {w.k}] need {w.n if dx else w.k}")
    if group_offsets.numel() != groups + 1 or group_offsets.device != x_sorted.device:
        raise ValueError(f"group_offsets must be [G + 1] = [{groups + 1}] on {x_sorted.device}, got "
                         f"{tuple(group_offsets.shape)} on {group_offsets.device}")
    out = torch.empty((x_sorted.shape[0], w.k if dx else w.n), dtype=x_sorted.dtype, device=x_sorted.device)
    if x_sorted.shape[0] == 0:
        return out
    if dx:
        return wgmma_int4_dx.wgmma_int4_dx(x_sorted, w, out, group_offsets, expert_ids)
    return wgmma_int4.wgmma_int4_grouped(x_sorted, group_offsets, w, out, ids=expert_ids)


def grouped_dequant_swiglu(x_sorted: Tensor, expert_offsets: Tensor, fmt: str | QuantFormat,
                           gate: Mapping[str, Tensor], up: Mapping[str, Tensor], lora: ExpertLora | None = None,
                           **fmt_kw) -> Tensor | None:
    """An expert MLP's first half, silu(x_sorted[rows_e] @ Gate_e^T) * (x_sorted[rows_e] @ Up_e^T), in one launch
    where the decode kernel serves (grouped_mma.py: int4 on bf16, a few rows per expert, outside batch-invariant
    mode), None elsewhere, for the caller to run the two projections and silu_mul. Its result is bitwise theirs
    through grouped_mma at its config (the projections' own config may split K over other warps: fp32 rounding).
    lora: gate's and up's expert LoRA, added to each before the SiLU (one more launch, for A x).
    Returns [T, I] in x_sorted.dtype."""
    if not configs.GROUPED_MMA_SWIGLU or not _lora_served(lora):
        return None
    w = resolve(fmt, gate, stacked=True, **fmt_kw)
    mma = _decode_config(x_sorted, w, swiglu=True)
    w_up = resolve(fmt, up, stacked=True, **fmt_kw) if mma is not None else None
    if w_up is None or not same_layout(w, w_up):
        return None  # (the caller's projections check the arguments)
    check_grouped(x_sorted, expert_offsets, w, dx=False)
    return grouped_mma(x_sorted, expert_offsets, w, mma, up=w_up, lora=lora)


def _decode_config(x: Tensor, w: PackedWeight, swiglu: bool = False) -> GemvConfig | None:
    """grouped_mma's config for rows x of stacked experts w where the decode kernel serves (int4 on bf16 through the
    packed-bf16 decoder, configs.pick_grouped_mma's batches), else None."""
    return pick_grouped_mma(x, w, swiglu) if fast_int4(w, x.dtype) else None


def _lora_served(lora: ExpertLora | None) -> bool:
    """Whether the decode kernel takes these expert adapters (none, or on and of a rank it holds in registers)."""
    return lora is None or configs.GROUPED_MMA_LORA and lora.a[0].shape[1] <= configs.GROUPED_MMA_MAX_RANK


def grouped_dequant_lora(x_sorted: Tensor, expert_offsets: Tensor, fmt: str | QuantFormat,
                         packed: Mapping[str, Tensor], lora: ExpertLora, **fmt_kw) -> Tensor | None:
    """grouped_dequant_linear plus one projection's expert LoRA, lora.scale * B_e (A_e x), in two launches where the
    decode kernel serves (as grouped_dequant_swiglu); None elsewhere. Returns [T, N] in x_sorted.dtype."""
    if not _lora_served(lora):
        return None
    w = resolve(fmt, packed, stacked=True, **fmt_kw)
    mma = _decode_config(x_sorted, w)
    if mma is None:
        return None  # (the caller's path checks the arguments)
    check_grouped(x_sorted, expert_offsets, w, dx=False)
    return grouped_mma(x_sorted, expert_offsets, w, mma, lora=lora)


def grouped_dequant_linear_dx(dy_sorted: Tensor, expert_offsets: Tensor, fmt: str | QuantFormat,
                              packed: Mapping[str, Tensor], *, config: TileConfig | None = None,
                              **fmt_kw) -> Tensor:
    """MoE dX over active experts: dx[rows_e] = dy_sorted[rows_e] @ W_e. dy_sorted: [T, N] -> [T, K]."""
    w = resolve(fmt, packed, stacked=True, **fmt_kw)
    return grouped_gemm(dy_sorted, expert_offsets, w, dx=True, config=config)
