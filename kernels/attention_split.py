"""Flash decoding for `paged_attention`: split each sequence's keys into fixed chunks, then merge the partials.

At small batch the unsplit decode grid (one program per GQA group and sequence) leaves most SMs idle: a
Qwen3-8B layer at batch 1 has 8 kv heads, so 8 programs on a 132-SM H200 walk every key serially. The split
path launches `_attn_kernel` with SPLIT on: program (chunk c, group, sequence) walks only keys
[c * CHUNK, (c + 1) * CHUNK) of its sequence with the unsplit loop and stores fp32 partials (row max m, sum of
exp2 l, unnormalized acc); `merge_partials` then combines a row's chunks in chunk order.

A split happens when the unsplit grid would leave at least half the SMs idle (decode is bound by K/V reads,
and a grid that already touches most SMs pulls most of the bandwidth: splitting it only adds the merge; the
H200 measured batch 16 on Qwen3-8B, 128 programs, slower split). The chunk is then a power of two >= BLOCK_N
(64), so every key block lies inside one chunk and the loop is the unsplit one, sized for about two programs
per SM: `split_chunk`. At batch 1 a Qwen3-8B layer (8 programs) at ~600 keys gets 64-key chunks, 80 programs
each walking one key block instead of 8 walking ten: at small batch decode attention is a chain of dependent
block loads. At ~4K keys it gets 128-key chunks (256 programs). A forced split (split=True) where the policy
would not split uses CHUNK.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .configs import sm_count
from .pdl import use_pdl, wait_for_producers

CHUNK = 256  # keys per split program of a forced split the policy would not make (tests, benchmarks)
MIN_CHUNK = 64  # attention._BLOCK_N: a key block never straddles two chunks
_MERGE_SPLITS = 16  # chunks merged per step: a [16, Dv_pad] fp32 tile stays in registers
def split_chunk(programs: int, max_keys: int, device: torch.device) -> int | None:
    """Keys per program for splitting decode over keys, from host shapes only (CUDA-graph capturable), or None:
    when the unsplit grid of `programs` fills at most half the SMs, enough chunks for about two programs per SM,
    each a power of two >= MIN_CHUNK; None otherwise or when a row holds only one chunk."""
    sms = sm_count(torch.device(device))  # (the CPU assumes an H200's)
    if 2 * programs > sms:
        return None
    want = -(-2 * sms // max(programs, 1))
    chunk = max(MIN_CHUNK, triton.next_power_of_2(-(-max_keys // want)))
    return chunk if chunk < max_keys else None


def should_split(programs: int, max_keys: int, device: torch.device) -> bool:
    return split_chunk(programs, max_keys, device) is not None


def num_splits(max_keys: int, chunk: int = CHUNK) -> int:
    return max(1, triton.cdiv(max_keys, chunk))


@triton.jit(do_not_specialize=["n_table"])
def _merge_kernel(
    part_ptr,
    ml_ptr,
    o_ptr,
    ctx_ptr,
    n_table,
    sp_b,
    sp_h,
    sp_s,
    sp_d,
    sml_b,
    sml_h,
    sml_s,
    so_b,
    so_h,
    so_d,
    s_ctx,
    PAGE: tl.constexpr,
    CHUNK: tl.constexpr,
    DV: tl.constexpr,
    DV_PAD: tl.constexpr,
    SB: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (query head, sequence): out = sum_c 2^(m_c - M) acc_c / sum_c 2^(m_c - M) l_c."""
    wait_for_producers(PDL)
    h = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    ctx = tl.load(ctx_ptr + b * s_ctx).to(tl.int32)
    n_keys = tl.minimum(ctx, n_table * PAGE)  # as in _attn_kernel
    n_used = (n_keys + CHUNK - 1) // CHUNK  # chunks holding keys; the others stored nothing and are skipped
    ml_row = ml_ptr + b * sml_b + h * sml_h
    part_row = part_ptr + b * sp_b + h * sp_h
    dv = tl.arange(0, DV_PAD)

    # Pass 1: the row's max over its chunks (max is exact, so lane-wise then across lanes is order-free).
    m_lanes = tl.full([SB], float("-inf"), dtype=tl.float32)
    for s0 in range(0, n_used, SB):
        s = s0 + tl.arange(0, SB)
        m_lanes = tl.maximum(m_lanes, tl.load(ml_row + s * sml_s, mask=s < n_used, other=float("-inf")))
    m_max = tl.max(m_lanes, 0)
    # Pass 2: every chunk rescaled to the one max (weights <= 1, the max chunk's exactly 1), summed lane-wise in
    # chunk order and across lanes at the end: a fixed order, so the result is deterministic. A used chunk saw
    # at least one key, so m_max is finite whenever the loop runs and masked lanes weigh exp2(-inf) = 0.
    l_lanes = tl.zeros([SB], dtype=tl.float32)
    acc = tl.zeros([SB, DV_PAD], dtype=tl.float32)
    for s0 in range(0, n_used, SB):
        s = s0 + tl.arange(0, SB)
        ok = s < n_used
        w = tl.exp2(tl.load(ml_row + s * sml_s, mask=ok, other=float("-inf")) - m_max)
        l_lanes += w * tl.load(ml_row + s * sml_s + 1, mask=ok, other=0.0)
        a = tl.load(part_row + s[:, None] * sp_s + dv[None, :] * sp_d, mask=ok[:, None] & (dv < DV)[None, :], other=0.0)
        acc += w[:, None] * a
    l_sum = tl.sum(l_lanes, 0)
    out = tl.sum(acc, 0) / tl.where(l_sum > 0.0, l_sum, 1.0)  # no key (ctx 0): acc = 0 gives 0, as unsplit
    tl.store(o_ptr + b * so_b + h * so_h + dv * so_d, out.to(o_ptr.dtype.element_ty), mask=dv < DV)


def merge_partials(part: Tensor, ml: Tensor, out: Tensor, context_lens: Tensor, n_table: int, page: int,
                   chunk: int = CHUNK) -> None:
    """part [B, H, S, Dv] fp32 unnormalized acc, ml [B, H, S, 2] fp32 (m, l) -> out [B, H, 1, Dv]."""
    bsz, h, _, dv = part.shape
    pdl = use_pdl(part.device)
    _merge_kernel[(h, bsz)](
        part,
        ml,
        out,
        context_lens,
        n_table,
        *part.stride(),
        *ml.stride()[:3],
        out.stride(0),
        out.stride(1),
        out.stride(3),
        context_lens.stride(0),
        PAGE=page,
        CHUNK=chunk,
        DV=dv,
        DV_PAD=max(16, triton.next_power_of_2(dv)),
        SB=_MERGE_SPLITS,
        PDL=pdl,
        launch_pdl=pdl,
        num_warps=4,
    )
