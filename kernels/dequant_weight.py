"""Dequantize packed weights (or a chunk of experts) to a dense bf16/fp16/fp32 tensor in one pass.

This serves the chunked path of the design (dequantize a few active experts, run a grouped GEMM, free
the copy), and large-M shapes where a transient dequantized chunk plus cuBLAS may beat the fused
kernel. It uses the same decoders as the GEMMs, so its values equal the tiles they multiply.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from torch import Tensor

from .dequant import dequant_tile, load_scales
from .formats import parse_format, resolve
from .gemm import fast_int4

if TYPE_CHECKING:
    from orbit_lightning.quant.formats import QuantFormat

_BN, _BK = 64, 128  # one tile per program: large enough to stream, small enough for registers


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, gs_ptr, out_ptr, ids_ptr, N, K, n_groups,
                    stride_we, stride_wn, stride_se, stride_sn, stride_oe, stride_on,
                    FMT: tl.constexpr, GROUP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    K_EVEN: tl.constexpr, FAST_INT4: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    slot = tl.program_id(2)
    e = tl.load(ids_ptr + slot).to(tl.int64)
    rows = pid_n * BN + tl.arange(0, BN)
    k0 = pid_k * BK
    if FMT == 3:
        gscale = tl.load(gs_ptr + e)
    else:
        gscale = 1.0
    scales = load_scales(s_ptr + e * stride_se, rows, k0, N, n_groups, stride_sn, gscale,
                         FMT, BN, BK, GROUP, K_EVEN)
    w = dequant_tile(w_ptr + e * stride_we, scales, rows, k0, N, K, stride_wn, FMT, BN, BK, GROUP, K_EVEN,
                     FAST_INT4)
    cols = k0 + tl.arange(0, BK)
    mask = (rows[:, None] < N) & (cols[None, :] < K)
    ptrs = out_ptr + slot.to(tl.int64) * stride_oe + rows[:, None] * stride_on + cols[None, :]
    tl.store(ptrs, w.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize(fmt: str | QuantFormat, packed: Mapping[str, Tensor], dtype: torch.dtype = torch.bfloat16,
               expert_ids: Tensor | None = None, **fmt_kw) -> Tensor:
    """Dense weights from packed ones: [N, K] for a 2-D weight, [E, N, K] for stacked experts, or
    [len(expert_ids), N, K] for the listed experts only (expert_ids: int tensor of valid expert indices;
    not range-checked, which would need a host sync). dtype: bf16, fp16 or fp32."""
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"dequantize produces bf16, fp16 or fp32, got {dtype}")
    values = packed.get(parse_format(fmt)[0].values_key) if isinstance(packed, Mapping) else None
    stacked = values is not None and values.dim() == 3
    w = resolve(fmt, packed, stacked=stacked, **fmt_kw)
    device = w.values.device
    if expert_ids is None:
        ids = torch.arange(w.experts or 1, device=device, dtype=torch.int32)
    elif not stacked:
        raise ValueError("expert_ids needs stacked expert weights [E, N, ...]")
    else:
        ids = expert_ids.to(device=device, dtype=torch.int32)
    out = torch.empty((ids.numel(), w.n, w.k), dtype=dtype, device=device)
    if out.numel():
        gs = w.global_scale if w.global_scale is not None else w.scale
        values = w.values if stacked else w.values.unsqueeze(0)
        scale = w.scale if stacked else w.scale.unsqueeze(0)
        grid = (triton.cdiv(w.n, _BN), triton.cdiv(w.k, _BK), ids.numel())
        _dequant_kernel[grid](
            values, scale, gs, out, ids, w.n, w.k, w.scale.shape[-1],
            values.stride(0), values.stride(1), scale.stride(0), scale.stride(1), out.stride(0), out.stride(1),
            FMT=w.fmt.code, GROUP=w.group, BN=_BN, BK=_BK, K_EVEN=w.k % _BK == 0,
            FAST_INT4=fast_int4(w, dtype), num_warps=4,
        )
    return out if stacked else out[0]
