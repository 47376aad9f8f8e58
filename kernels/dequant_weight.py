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

from .dequant import _int4_to_bf16, _load_words, dequant_tile, load_scales, load_word_scales
from .formats import parse_format, resolve
from .gemm import fast_int4

if TYPE_CHECKING:
    from orbit_lightning.quant.formats import QuantFormat

_BN, _BK = 64, 128  # generic path: one tile per program, large enough to stream, small enough for registers
# int4 -> bf16 (the training path's transient weight): (rows, K, warps) per program. Each thread decodes
# whole words (8 values = one 16-byte store), see _dequant_int4_kernel.
INT4_TILE = (32, 256, 4)
INT4_STORE_CACHE = ""  # cache modifier of the bf16 stores ("" = default, ".cs" = streaming)


@triton.jit
def _tile_origin(ids_ptr, BN: tl.constexpr, BK: tl.constexpr, HAS_IDS: tl.constexpr):
    """(output slot, expert, weight rows, first K column) of this program's tile."""
    slot = tl.program_id(2)
    if HAS_IDS:
        e = tl.load(ids_ptr + slot).to(tl.int64)
    else:
        e = slot.to(tl.int64)
    return slot, e, tl.program_id(0) * BN + tl.arange(0, BN), tl.program_id(1) * BK


@triton.jit
def _out_tile(out_ptr, slot, rows, k0, N, K, stride_oe, stride_on, BK: tl.constexpr):
    """Pointers and mask of the output tile out[slot, rows, k0:k0+BK]."""
    cols = k0 + tl.arange(0, BK)
    mask = (rows[:, None] < N) & (cols[None, :] < K)
    return out_ptr + slot.to(tl.int64) * stride_oe + rows[:, None] * stride_on + cols[None, :], mask


@triton.jit
def _dequant_kernel(
    w_ptr,
    s_ptr,
    gs_ptr,
    out_ptr,
    ids_ptr,
    N,
    K,
    n_groups,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_oe,
    stride_on,
    FMT: tl.constexpr,
    GROUP: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    K_EVEN: tl.constexpr,
    FAST_INT4: tl.constexpr,
    HAS_IDS: tl.constexpr,
):
    slot, e, rows, k0 = _tile_origin(ids_ptr, BN, BK, HAS_IDS)
    if FMT == 3:
        gscale = tl.load(gs_ptr + e)
    else:
        gscale = 1.0
    scales = load_scales(s_ptr + e * stride_se, rows, k0, N, n_groups, stride_sn, gscale, FMT, BN, BK, GROUP, K_EVEN)
    w = dequant_tile(w_ptr + e * stride_we, scales, rows, k0, N, K, stride_wn, FMT, BN, BK, GROUP, K_EVEN, FAST_INT4)
    ptrs, mask = _out_tile(out_ptr, slot, rows, k0, N, K, stride_oe, stride_on, BK)
    tl.store(ptrs, w.to(out_ptr.dtype.element_ty), mask=mask)


# int4 -> bf16 with the packed-bf16 decoder, laid out for streaming: stride_wn is not specialized, so the
# compiler cannot prove the packed rows 16-byte aligned and gives each thread single words (4-byte loads,
# still coalesced across the warp). A thread then owns the 8 values of its word, which are exactly one
# 16-byte store, and its scales (one per word, in the words' shape); nothing is exchanged between threads.
# (With 16-byte word loads a thread decodes 32 values, but a store moves at most 16 bytes, so the tile
# would be reshuffled through shared memory before every store.)
@triton.jit(do_not_specialize=["stride_wn"])
def _dequant_int4_kernel(
    w_ptr,
    s_ptr,
    out_ptr,
    ids_ptr,
    N,
    K,
    n_groups,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_oe,
    stride_on,
    GROUP: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    K_EVEN: tl.constexpr,
    HAS_IDS: tl.constexpr,
    STORE_CACHE: tl.constexpr,
    TILED: tl.constexpr,
):
    slot, e, rows, k0 = _tile_origin(ids_ptr, BN, BK, HAS_IDS)
    words = _load_words(w_ptr + e * stride_we, rows, k0, N, K // 8, stride_wn, BN, BK, 8, K_EVEN, TILED)
    word_scales = load_word_scales(s_ptr + e * stride_se, rows, k0, N, n_groups, stride_sn, BN, BK, GROUP, K_EVEN,
                                   TILED)
    w = _int4_to_bf16(words, word_scales, BN, BK, TILED)
    ptrs, mask = _out_tile(out_ptr, slot, rows, k0, N, K, stride_oe, stride_on, BK)
    tl.store(ptrs, w, mask=mask, cache_modifier=STORE_CACHE)


def dequantize(
    fmt: str | QuantFormat,
    packed: Mapping[str, Tensor],
    dtype: torch.dtype = torch.bfloat16,
    expert_ids: Tensor | None = None,
    **fmt_kw,
) -> Tensor:
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
        ids, count = None, w.experts or 1  # program index = expert index: no id tensor to build
    elif not stacked:
        raise ValueError("expert_ids needs stacked expert weights [E, N, ...]")
    else:
        ids = expert_ids.to(device=device, dtype=torch.int32)
        count = ids.numel()
    # A 2-D weight is launched as one "expert" with a zero expert stride (no unsqueeze / index views: each
    # torch op costs host time, and this sits in front of every chunked GEMM).
    out = torch.empty((count, w.n, w.k) if stacked else (w.n, w.k), dtype=dtype, device=device)
    if out.numel():

        def strides(t: Tensor) -> tuple[int, int]:
            return (t.stride(0), t.stride(1)) if stacked else (0, t.stride(0))

        (swe, swn), (sse, ssn), (soe, son) = strides(w.values), strides(w.scale), strides(out)
        ids_arg = ids if ids is not None else w.scale  # unread without ids
        if fast_int4(w, dtype):
            bn, bk, warps = INT4_TILE
            _dequant_int4_kernel[(triton.cdiv(w.n, bn), triton.cdiv(w.k, bk), count)](
                w.values,
                w.scale,
                out,
                ids_arg,
                w.n,
                w.k,
                w.scale.shape[-1],
                swe,
                swn,
                sse,
                ssn,
                soe,
                son,
                GROUP=w.group,
                BN=bn,
                BK=bk,
                K_EVEN=w.k % bk == 0,
                HAS_IDS=ids is not None,
                STORE_CACHE=INT4_STORE_CACHE,
                TILED=w.tiled,
                num_warps=warps,
            )
        else:
            gs = w.global_scale if w.global_scale is not None else w.scale
            _dequant_kernel[(triton.cdiv(w.n, _BN), triton.cdiv(w.k, _BK), count)](
                w.values,
                w.scale,
                gs,
                out,
                ids_arg,
                w.n,
                w.k,
                w.scale.shape[-1],
                swe,
                swn,
                sse,
                ssn,
                soe,
                son,
                FMT=w.fmt.code,
                GROUP=w.group,
                BN=_BN,
                BK=_BK,
                K_EVEN=w.k % _BK == 0,
                FAST_INT4=fast_int4(w, dtype),
                HAS_IDS=ids is not None,
                num_warps=4,
            )
    return out
