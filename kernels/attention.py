"""Batch-invariant attention: teacher-forced / prefill `attention` and paged decode `paged_attention`.

Both launch one kernel body (`_attn_kernel`; the PAGED constexpr only changes how key and value addresses are
formed) with one fixed tile config, so a query row's output is bitwise the same whatever the batch size, its
row in the batch, its left padding, Tq, or where the paged cache stores its keys:
- Rows are independent. A tile's rows are consecutive queries of one head (prefill) or the query heads of one
  GQA group (decode). Every op on a row (its MMA dot products, row max, row sum, rescale) reads only that row,
  and the same tile shapes and num_warps select the same MMA instructions and register layouts, hence the
  same reduction order inside them.
- Keys come in the same order. A row's loop starts at its logical key 0 (its first unpadded key: kv_start[b]
  in prefill, 0 in decode) and walks BLOCK_N-key blocks in order, so logical key j is always lane
  j % BLOCK_N of block j // BLOCK_N, wherever it is stored.
- Masked keys are exact no-ops. Their score is -inf, so p = 0 (keys past the end are also loaded as zeros); a
  block without a visible key keeps m (alpha = 1 exactly) and adds exact zeros to l and acc. A prefill tile
  walks to its last row's position, so its earlier rows visit extra fully masked blocks that decode never
  visits; they change nothing.
- The code is the same. Length and offset ints are not value-specialized (Triton would compile Tq == 1 or
  Tk % 16 == 0 separately; strides still are, which only changes addressing) and mul+add contraction is off,
  so every rounding step is the one written here, in both variants.
The math is flash attention's: s = (q . k) * scale in fp32 (log2(e) folded in, exp2), online softmax in fp32,
p cast to the value dtype for the p @ v MMA, out = acc / l. A query that sees no key (left padding) gives 0.
At small batch, decode may instead split each row's keys over programs (SPLIT; attention_split.py, flash
decoding): deterministic, but rounded differently, so never in batch-invariant mode.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .attention_split import CHUNK, merge_partials, num_splits, split_chunk
from .mode import is_batch_invariant
from .pdl import use_pdl, wait_for_producers

# The one tile config of every launch. 64 x 64 with 4 warps is a Hopper warpgroup MMA tile for prefill;
# decode packs a GQA group's query heads as rows, so its extra MMA work hides under the key/value loads.
_BLOCK_M = 64  # query rows per program
_BLOCK_N = 64  # keys per step
# Warps per program, read at each launch (prefill and decode alike, so batch-invariant mode is unaffected): a knob
# for bench/rollout.py --attn-warps. With 4, ptxas for sm_90a spills 450-1000 bytes per thread at head dim 128; with
# 8, nothing (192 registers unsplit, 253 split). The 4-warp choice predates that finding and is not yet re-timed.
NUM_WARPS = 4
_NUM_STAGES = 2  # keeps K and V stages of a 256-wide (padded 192) head within shared memory
_LOG2E = 1.4426950408889634
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit(do_not_specialize=["rep", "Tq", "Tk", "n_table"])
def _attn_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    start_ptr,
    table_ptr,
    ctx_ptr,
    qk_scale,
    rep,
    Tq,
    Tk,
    n_table,
    sq_b,
    sq_h,
    sq_t,
    sq_d,
    sk_0,
    sk_1,
    sk_h,
    sk_d,
    sv_0,
    sv_1,
    sv_h,
    sv_d,
    so_b,
    so_h,
    so_t,
    so_d,
    s_start,
    st_b,
    st_w,
    s_ctx,
    ml_ptr,
    sml_b,
    sml_h,
    sml_s,
    PAGED: tl.constexpr,
    PAGE: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    DK_PAD: tl.constexpr,
    DV_PAD: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    PREC: tl.constexpr,
    SPLIT: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    """k/v strides (sk_0, sk_1) are (batch, position) for prefill and (block, slot) for the paged cache.
    SPLIT (paged only, see attention_split): o_ptr is fp32 partials [B, H, chunks, Dv] and ml_ptr [B, H, chunks, 2]."""
    wait_for_producers(PDL)
    if SPLIT:  # dim 0 enumerates (key chunk, row tile) pairs
        n_m = (rep + BM - 1) // BM
        pid_m = tl.program_id(0) % n_m
        chunk = tl.program_id(0) // n_m
    else:
        pid_m = tl.program_id(0)
    pid_h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    r = pid_m * BM + tl.arange(0, BM)
    if PAGED:  # rows: the query heads of kv head pid_h; the one query sits at position ctx - 1
        row_ok = r < rep
        row_h = (pid_h * rep + r).to(tl.int64)
        row_t = tl.zeros([BM], dtype=tl.int64)
        kvh = pid_h
        ctx = tl.load(ctx_ptr + b * s_ctx).to(tl.int32)
        qpos = tl.zeros([BM], dtype=tl.int32) + (ctx - 1)
        start = 0
        n_keys = tl.minimum(ctx, n_table * PAGE)  # never read past the block table
        if SPLIT:  # CHUNK is a multiple of BN: the chunk's blocks are the unsplit loop's, masked alike
            t_lo = chunk * CHUNK
            t_end = tl.minimum(n_keys, t_lo + CHUNK)
        else:
            t_lo = 0
            t_end = n_keys
    else:  # rows: consecutive queries of head pid_h, aligned to the end of the keys
        row_ok = r < Tq
        row_h = tl.zeros([BM], dtype=tl.int64) + pid_h
        row_t = r.to(tl.int64)
        kvh = pid_h // rep
        start = tl.load(start_ptr + b * s_start).to(tl.int32)
        t_lo = 0
        qpos = Tk - Tq + r - start  # relative to the first unpadded key; < 0 for a left-pad query
        n_keys = Tk - start
        t_end = Tk - Tq + tl.minimum(pid_m * BM + BM, Tq) - start  # the tile's last visible key + 1
    dk = tl.arange(0, DK_PAD)
    dv = tl.arange(0, DV_PAD)
    q_rows = q_ptr + b * sq_b + row_h * sq_h + row_t * sq_t
    q = tl.load(q_rows[:, None] + dk[None, :] * sq_d, mask=row_ok[:, None] & (dk < DK)[None, :], other=0.0)
    k_head = k_ptr + kvh.to(tl.int64) * sk_h
    v_head = v_ptr + kvh.to(tl.int64) * sv_h

    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, DV_PAD], dtype=tl.float32)
    for t0 in range(t_lo, t_end, BN):
        t = t0 + tl.arange(0, BN)  # logical key indices
        t_ok = t < n_keys
        if PAGED:
            blk = tl.load(table_ptr + b * st_b + (t // PAGE) * st_w, mask=t_ok, other=0).to(tl.int64)
            slot = (t % PAGE).to(tl.int64)
            k_off = blk * sk_0 + slot * sk_1
            v_off = blk * sv_0 + slot * sv_1
        else:
            pos = (start + t).to(tl.int64)
            k_off = b * sk_0 + pos * sk_1
            v_off = b * sv_0 + pos * sv_1
        kt = tl.load(k_head + k_off[None, :] + dk[:, None] * sk_d, mask=t_ok[None, :] & (dk < DK)[:, None], other=0.0)
        vb = tl.load(v_head + v_off[:, None] + dv[None, :] * sv_d, mask=t_ok[:, None] & (dv < DV)[None, :], other=0.0)
        s = tl.dot(q, kt.to(q.dtype), input_precision=PREC) * qk_scale
        s = tl.where((t[None, :] <= qpos[:, None]) & t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet subtracts 0 instead of -inf (exp2(-inf - 0) = 0, not NaN); a block
        # that leaves the max unchanged rescales by exactly 1, whatever exp2's rounding of 2^0.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.where(m_new == m_i, 1.0, tl.exp2(m_i - m_sub))
        p = tl.exp2(s - m_sub[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(q.dtype), vb.to(q.dtype), acc, input_precision=PREC)
        m_i = m_new
    if SPLIT:  # unnormalized fp32 partials; a chunk past the row's keys stores nothing (the merge skips it)
        keep = r < tl.where(t_lo < n_keys, rep, 0)  # row_ok, or no row (`row_ok & scalar` breaks the interpreter)
        o_rows = o_ptr + b * so_b + row_h * so_h + chunk * so_t
        tl.store(o_rows[:, None] + dv[None, :] * so_d, acc, mask=keep[:, None] & (dv < DV)[None, :])
        ml_rows = ml_ptr + b * sml_b + row_h * sml_h + chunk * sml_s
        tl.store(ml_rows, m_i, mask=keep)
        tl.store(ml_rows + 1, l_i, mask=keep)
    else:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # a row that saw no key has acc = 0 and outputs 0
        o_rows = o_ptr + b * so_b + row_h * so_h + row_t * so_t
        tl.store(
            o_rows[:, None] + dv[None, :] * so_d,
            out.to(o_ptr.dtype.element_ty),
            mask=row_ok[:, None] & (dv < DV)[None, :],
        )


def _pad(d: int) -> int:
    return max(16, triton.next_power_of_2(d))  # tl.dot needs every dim >= 16


def _launch(grid, q, k, v, out, start, table, ctx, scale, rep, tq, tk, k_strides, v_strides, paged, page, ml=None,
            chunk=CHUNK):
    """ml: the split path's [B, H, chunks, 2] (m, l) buffer; `out` is then the fp32 partial acc of `chunk`-key
    chunks."""
    pdl = use_pdl(q.device)
    _attn_kernel[grid](
        q,
        k,
        v,
        out,
        start,
        table,
        ctx,
        float(scale) * _LOG2E,
        rep,
        tq,
        tk,
        table.shape[-1],
        *q.stride(),
        *k_strides,
        *v_strides,
        *out.stride(),
        start.stride(0),
        *table.stride(),
        ctx.stride(0),
        out if ml is None else ml,
        *(ml.stride()[:3] if ml is not None else (0, 0, 0)),
        PAGED=paged,
        PAGE=page,
        DK=q.shape[-1],
        DV=v.shape[-1],
        DK_PAD=_pad(q.shape[-1]),
        DV_PAD=_pad(v.shape[-1]),
        BM=_BLOCK_M,
        BN=_BLOCK_N,
        # fp32 inputs ask for true fp32 products; Triton would otherwise use tf32 tensor cores.
        PREC="ieee" if q.dtype == torch.float32 else "tf32",
        SPLIT=ml is not None,
        CHUNK=chunk,
        PDL=pdl,
        launch_pdl=pdl,
        num_warps=NUM_WARPS,
        num_stages=_NUM_STAGES,
        enable_fp_fusion=False,
    )


def _check_dtypes(q: Tensor, *others: Tensor) -> None:
    if q.dtype not in _DTYPES:
        raise TypeError(f"attention q must be bf16, fp16 or fp32, got {q.dtype}")
    for t in others:
        if not t.is_floating_point():
            raise TypeError(f"attention keys and values must be floating point, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"attention inputs must share a device: q is on {q.device}, another on {t.device}")


def _check_index(x: Tensor, shape: tuple[int, ...], what: str, device: torch.device) -> None:
    if tuple(x.shape) != shape or x.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{what} must be an int32/int64 tensor of shape {list(shape)}, got {x.dtype} {list(x.shape)}")
    if x.device != device:
        raise ValueError(f"{what} is on {x.device} but q is on {device}")


def attention(q: Tensor, k: Tensor, v: Tensor, scale: float, kv_start: Tensor | None = None) -> Tensor:
    """Causal attention with queries aligned to the end of the keys (query i sits at key Tk - Tq + i).

    q [B, H, Tq, Dk], k [B, Hkv, Tk, Dk], v [B, Hkv, Tk, Dv] (any strides; query head h reads kv head
    h // (H // Hkv)). kv_start [B] int in [0, Tk]: the first valid key of each row (its left padding),
    default 0. Query i attends keys kv_start[b] <= j <= Tk - Tq + i; a query before kv_start[b] outputs 0.
    Returns [B, H, Tq, Dv] in q.dtype.
    """
    _check_dtypes(q, k, v)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"attention expects 4-D q, k, v, got {q.dim()}, {k.dim()}, {v.dim()} dims")
    bsz, h, tq, dk = q.shape
    if k.shape[0] != bsz or v.shape[0] != bsz or k.shape[1:3] != v.shape[1:3] or k.shape[3] != dk:
        raise ValueError(
            f"attention shapes disagree: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} "
            "(want q [B, H, Tq, Dk], k [B, Hkv, Tk, Dk], v [B, Hkv, Tk, Dv])"
        )
    hkv, tk = k.shape[1], k.shape[2]
    if hkv == 0 or h % hkv:
        raise ValueError(f"attention needs H % Hkv == 0, got H={h}, Hkv={hkv}")
    if tq > tk:
        raise ValueError(f"attention needs Tq <= Tk (queries are the last Tq keys), got Tq={tq}, Tk={tk}")
    if kv_start is None:
        kv_start = torch.zeros(bsz, dtype=torch.int32, device=q.device)
    _check_index(kv_start, (bsz,), "kv_start", q.device)
    out = torch.empty((bsz, h, tq, v.shape[3]), dtype=q.dtype, device=q.device)
    if out.numel():
        _launch(
            (triton.cdiv(tq, _BLOCK_M), h, bsz),
            q, k, v, out, kv_start, kv_start[:, None], kv_start,
            scale, h // hkv, tq, tk,
            (k.stride(0), k.stride(2), k.stride(1), k.stride(3)),
            (v.stride(0), v.stride(2), v.stride(1), v.stride(3)),
            paged=False, page=1,
        )  # fmt: skip
    return out


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    split: bool | None = None,
) -> Tensor:
    """Decode attention of each sequence's one new query over its paged keys (the new key already written).

    q [B, H, 1, Dk]; k_cache [blocks, block_size, Hkv, Dk], v_cache [blocks, block_size, Hkv, Dv]; block_tables
    [B, W] int (key j of sequence b is k_cache[block_tables[b, j // block_size], j % block_size]); context_lens
    [B] int (keys 0..ctx-1 are attended; 0 gives zeros). Returns [B, H, 1, Dv] in q.dtype. No host syncs:
    CUDA-graph capturable.

    split: walk each row's keys in chunks on parallel programs and merge them (attention_split; for small
    batches with long key spans). False: never, and a row equals `attention`'s row for the same query
    and keys bit for bit (the batch-invariant path). None: False in batch-invariant mode, else decided from
    the shapes (B, Hkv, W * block_size), never from context_lens. True: always (for tests and benchmarks).
    """
    _check_dtypes(q, k_cache, v_cache)
    if q.dim() != 4 or q.shape[2] != 1:
        raise ValueError(f"paged_attention expects q [B, H, 1, Dk], got {list(q.shape)}")
    if k_cache.dim() != 4 or v_cache.dim() != 4 or k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(
            f"paged_attention expects k_cache [blocks, block_size, Hkv, Dk] and v_cache [blocks, block_size, Hkv, "
            f"Dv], got {list(k_cache.shape)} and {list(v_cache.shape)}"
        )
    bsz, h, _, dk = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    if k_cache.shape[3] != dk:
        raise ValueError(f"paged_attention: q has Dk={dk} but k_cache has {k_cache.shape[3]}")
    if hkv == 0 or h % hkv:
        raise ValueError(f"paged_attention needs H % Hkv == 0, got H={h}, Hkv={hkv}")
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [B, W], got {list(block_tables.shape)}")
    _check_index(block_tables, (bsz, block_tables.shape[1]), "block_tables", q.device)
    _check_index(context_lens, (bsz,), "context_lens", q.device)
    dv = v_cache.shape[3]
    out = torch.empty((bsz, h, 1, dv), dtype=q.dtype, device=q.device)
    if not out.numel():
        return out
    rep = h // hkv
    tiles = triton.cdiv(rep, _BLOCK_M)
    max_keys = block_tables.shape[1] * page
    chunk = split_chunk(bsz * hkv * tiles, max_keys, q.device)
    if split is None:
        split = not is_batch_invariant() and chunk is not None
    chunk = chunk or CHUNK
    chunks = num_splits(max_keys, chunk) if split else 1
    dst, ml = out, None
    if split:
        dst = torch.empty((bsz, h, chunks, dv), dtype=torch.float32, device=q.device)
        ml = torch.empty((bsz, h, chunks, 2), dtype=torch.float32, device=q.device)
    _launch(
        (tiles * chunks, hkv, bsz),
        q, k_cache, v_cache, dst, context_lens, block_tables, context_lens,
        scale, rep, 1, 0,
        (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3)),
        (v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3)),
        paged=True, page=page, ml=ml, chunk=chunk,
    )  # fmt: skip
    if split:
        merge_partials(dst, ml, out, context_lens, block_tables.shape[1], page, chunk)
    return out
