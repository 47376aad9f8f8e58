"""Bandwidth-bound small-M (decode) forward: y[M, N] = x[M, K] @ W^T for M <= 16, W packed [N, K], in Triton tiles.

For int4 on bf16 at M <= 8, and at 9-16 rows of small weights, gemv_mma.py's per-thread mma kernel serves instead
(configs.pick_gemv; on Hopper wgmma_int4 takes the other 9-16-row cases); these kernels take every other format, M
9-16 where neither serves, and what the mma kernel cannot read.

At decode sizes the work is streaming the packed weight once, so the kernel is shaped for memory
parallelism: small programs (one warp each, ~8-12 per SM) each decode [BN, BK] weight tiles with the
shared decoders and the reduction over K is split across programs. Splits are combined
deterministically: each split stores an fp32 partial and the last program of an output tile (an atomic
ticket) sums the partials in split order, so results are bitwise reproducible run to run.

Two ways to multiply the decoded tile (GemvConfig.dot):

- DOT (the default): tl.dot of the tile with the activations (M padded to 16, or for M = 1 one row
  broadcast). For int4 the words are decoded by the packed-bf16 decoder in a permuted K order that both
  operands share (see _k_permute), meant to land in the mma operand registers directly; with Triton 3.6
  and 3.9 the decoded tile still passes through shared memory (sm_90 SASS, bench/RESULTS.md), which
  gemv_mma.py avoids. The next tile's words are prefetched one iteration ahead.
- FMA: y[m, n] += sum_k w[n, k] x[m, k] on the CUDA cores, one activation row at a time. Within ~10% of
  DOT at M = 1 and slower above (its FMA count grows with M); kept for measurements (bench/gemv_sweep.py).

Either way each weight is the value the tl.dot kernels multiply (the same decoders, rounded to the
activation dtype) and products are accumulated in fp32, so this is the same function as
`gemm._dense_kernel`'s up to the order of the fp32 summation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from .configs import GEMV_TILES, GemvConfig, gemv_splits, mma_ok, tma_ok
from .dequant import (
    _expand_groups,
    _int4_words_to_bf16,
    _int4_words_to_f32,
    _load_words,
    _nibbles_to_tile,
    apply_scales,
    dequant_tile,
    int4_values,
    load_scales,
    value_planes,
)
from .formats import PackedWeight
from .gemv_lora import N_COUNTERS, LoraDelta, lora_arrive, lora_leave, lora_rank_program
from .gemv_mma import gemv_mma
from .gemv_out import flat_program, launch_args, store_out
from .pdl import use_pdl, wait_for_producers
from .timeline import linear_program, stamp


@triton.jit
def _fma_rows(w, x_ptr, m0, M, stride_xm, cols, c_ok, acc, BM: tl.constexpr):
    """acc[BN, BM] + w[BN, BK] @ x[m0:m0+BM, cols]^T, one activation row at a time on the FMA units."""
    for i in tl.static_range(BM):
        row = m0 + i + 0 * cols  # as a tensor: the interpreter takes no scalar & tensor masks
        xm = tl.load(x_ptr + row * stride_xm + cols, mask=c_ok & (row < M), other=0.0)
        part = tl.sum(w * xm.to(tl.float32)[None, :], axis=1)  # [BN]
        acc = tl.where(tl.arange(0, BM)[None, :] == i, acc + part[:, None], acc)
    return acc


# The tensor-core path multiplies a K-permuted tile: a dot product may visit K in any order as long as
# weights and activations agree, and the order below is the one in which each thread's decoded registers
# already are the mma operand (with 4 threads along K per row, as a 16-word-wide tile is loaded, thread t
# holds words 4t..4t+3 of a row, i.e. values 32t + 8w + j for w, j < 4 (BK = 128)); the decoder pairs
# nibbles j and j + 4 in one register, and Triton's bf16 mma operand holds 4 consecutive K per thread.
# Within a tile, actual index 32t + 8w + 4p + 2j1 + j0 (general BK: (BK/4)t + 8w + ...) goes to logical
# index 16(2w + j1) + 4t + 2j0 + p.
@triton.jit
def _k_permute(t, ROWS: tl.constexpr, BK: tl.constexpr):
    """[ROWS, BK] in natural K order -> the same values in the dot's K order (see above)."""
    t6 = tl.reshape(t, (ROWS, 4, BK // 32, 2, 2, 2))  # [r, t, w, p, j1, j0]
    return tl.reshape(tl.permute(t6, (0, 2, 4, 1, 5, 3)), (ROWS, BK))  # [r, w, j1, t, j0, p]


@triton.jit
def _k_permute_nibbles(o0, o1, o2, o3, o4, o5, o6, o7, ROWS: tl.constexpr, BK: tl.constexpr):
    """The eight decoded value planes [ROWS, BK // 8] (oj = value j of each word: dequant.value_planes) -> [ROWS, BK]
    in the dot's K order; equals _k_permute of the interleaved tile, but needs no register moves."""
    W: tl.constexpr = BK // 32
    p0 = tl.reshape(tl.join(o0, o4), (ROWS, 4, W, 2))  # [r, t, w, p] for j = 0
    p1 = tl.reshape(tl.join(o1, o5), (ROWS, 4, W, 2))
    p2 = tl.reshape(tl.join(o2, o6), (ROWS, 4, W, 2))
    p3 = tl.reshape(tl.join(o3, o7), (ROWS, 4, W, 2))
    q = tl.join(tl.join(p0, p1), tl.join(p2, p3))  # [r, t, w, p, j0, j1]
    return tl.reshape(tl.permute(q, (0, 2, 5, 1, 4, 3)), (ROWS, BK))  # [r, w, j1, t, j0, p]


@triton.jit
def _load_x(x_ptr, m0, offs_m, m_ok, stride_xm, k0, k_hi, BM: tl.constexpr, BK: tl.constexpr, ONE_ROW: tl.constexpr):
    """Activations x[offs_m, k0:k0+BK] as [BM, BK] (0 outside rows < M and K < k_hi), or only row m0 as [BK]
    when ONE_ROW."""
    cols = k0 + tl.arange(0, BK)
    if ONE_ROW:
        x = tl.load(x_ptr + m0 * stride_xm + cols, mask=cols < k_hi, other=0.0)
    else:
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :], mask=m_ok[:, None] & (cols < k_hi)[None, :],
                    other=0.0)  # fmt: skip
    return x


@triton.jit
def _dot_step(w, x, acc, BM: tl.constexpr, BK: tl.constexpr, ONE_ROW: tl.constexpr):
    """acc[BN, BM] + w @ x^T for a K-permuted weight tile w and activations from _load_x."""
    if ONE_ROW:  # M = 1: one activation row, broadcast to the dot's minimum width
        x = tl.broadcast_to(_k_permute(x[None, :], 1, BK), (BM, BK))
    else:
        x = _k_permute(x, BM, BK)
    if x.dtype == tl.float32:
        acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee")
    else:
        acc = tl.dot(w, tl.trans(x), acc)
    return acc


@triton.jit
def _load_packed(
    w_ptr,
    s_ptr,
    rows,
    k0,
    n_rows,
    K,
    n_groups,
    stride_wn,
    stride_sn,
    FMT: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP: tl.constexpr,
    K_EVEN: tl.constexpr,
):
    """int4 words [BN, BK // 8] and load_scales' scales of W[rows, k0:k0+BK]; rows >= n_rows read nothing."""
    words = _load_words(w_ptr, rows, k0, n_rows, K // 8, stride_wn, BN, BK, 8, K_EVEN, FMT == 5)
    scales = load_scales(s_ptr, rows, k0, n_rows, n_groups, stride_sn, 1.0, FMT, BN, BK, GROUP, K_EVEN)
    return words, scales


@triton.jit
def _generic_tile(
    w_ptr,
    s_ptr,
    rows,
    k0,
    n_rows,
    K,
    n_groups,
    stride_wn,
    stride_sn,
    gscale,
    FMT: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP: tl.constexpr,
    K_EVEN: tl.constexpr,
    DTYPE: tl.constexpr,
    DOT: tl.constexpr,
):
    """W[rows, k0:k0+BK] through the generic decoders, rounded to the activation dtype (the value the tl.dot
    kernels multiply): in the dot's K order for DOT, else natural order in fp32; rows >= n_rows are 0."""
    scales = load_scales(s_ptr, rows, k0, n_rows, n_groups, stride_sn, gscale, FMT, BN, BK, GROUP, K_EVEN)
    w = dequant_tile(w_ptr, scales, rows, k0, n_rows, K, stride_wn, FMT, BN, BK, GROUP, K_EVEN, False).to(DTYPE)
    if DOT:
        w = _k_permute(w, BN, BK)
    else:
        w = w.to(tl.float32)
    return w


@triton.jit
def _int4_tile_mma(words, scales, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr, PAIRED: tl.constexpr):
    """bf16 [BN, BK] in the dot's K order from int4 words [BN, BK // 8] (PAIRED: int4-tiled's nibble order) and
    load_scales' scales."""
    if BK >= GROUP:  # one scale per word
        word_scales = _expand_groups(scales, BN, BK // 8, GROUP // 8).to(tl.bfloat16)
    else:
        word_scales = tl.broadcast_to(scales, (BN, BK // 8)).to(tl.bfloat16)
    o0, o1, o2, o3, o4, o5, o6, o7 = _int4_words_to_bf16(words, word_scales)
    v0, v1, v2, v3, v4, v5, v6, v7 = value_planes(o0, o1, o2, o3, o4, o5, o6, o7, PAIRED)
    return _k_permute_nibbles(v0, v1, v2, v3, v4, v5, v6, v7, BN, BK)


@triton.jit
def _int4_tile_f32(words, scales, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr, PAIRED: tl.constexpr):
    """fp32 [BN, BK] in K order (values rounded to bf16) from int4 words (PAIRED: int4-tiled's nibble order) and
    load_scales' scales."""
    if BK >= GROUP:
        word_scales = _expand_groups(scales, BN, BK // 8, GROUP // 8).to(tl.bfloat16)
    else:
        word_scales = tl.broadcast_to(scales, (BN, BK // 8)).to(tl.bfloat16)
    o0, o1, o2, o3, o4, o5, o6, o7 = _int4_words_to_f32(words, word_scales)
    return _nibbles_to_tile(o0, o1, o2, o3, o4, o5, o6, o7, BN, BK, PAIRED)


# M and the split count are never specialized, so one binary serves every decode batch size. Nor is the
# scale row stride: unproven alignment makes the compiler load one scale per thread (2 bytes, not a
# 16-byte vector of 8 groups), which is the register layout the decoder wants: thread (row, group) owns
# the words of its group, so no scale is exchanged between threads before the decode.
@triton.jit(do_not_specialize=["M", "n_splits", "stride_sn", "N_A", "lst1", "lst2", "lr", "lslices"])
def _gemv_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, out_ptr, ws_ptr, cnt_ptr,
                 M, N, K, n_groups, k_per_split, n_splits,
                 stride_xm, stride_wn, stride_sn, stride_om,
                 N_A, la0, la1, la2, lb0, lb1, lb2, ls0, ls1, ls2, lst1, lst2, lr, lslices, lpart, lt, lcnt, stamp_ptr,
                 FMT: tl.constexpr, GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, DOT: tl.constexpr, K_EVEN: tl.constexpr, FAST_INT4: tl.constexpr,
                 SPLIT: tl.constexpr, PREFETCH: tl.constexpr, ONE_ROW: tl.constexpr, TWO: tl.constexpr,
                 PDL: tl.constexpr, LORA: tl.constexpr, BR: tl.constexpr, STAMPS: tl.constexpr):  # fmt: skip
    stamp(stamp_ptr, linear_program(), 0, STAMPS)  # (timeline.py: compiled out unless STAMPS)
    if LORA:
        pid_n, split, pid_m, is_rank = flat_program(N, n_splits, N_A, BN)
    else:
        pid_n, split, pid_m, is_rank = tl.program_id(0), tl.program_id(1), tl.program_id(2), False
    if is_rank:
        wait_for_producers(PDL)
        arrived = lora_arrive(lt, LORA)
        lora_rank_program(tl.program_id(0), x_ptr, M, K, stride_xm, la0, la1, la2, lr, lslices, lpart, lt, lcnt,
                          arrived, BM, BR, ONE_ROW)  # fmt: skip
    else:
        rows = pid_n * BN + tl.arange(0, BN)
        m0 = pid_m.to(tl.int64) * BM
        offs_m = m0 + tl.arange(0, BM)
        m_ok = offs_m < M
        k_lo = tl.multiple_of(split * k_per_split, BK)
        k_hi = min(k_lo + k_per_split, K)
        if FMT == 3:
            gscale = tl.load(gs_ptr)
        else:
            gscale = 1.0
        acc = tl.zeros((BN, BM), dtype=tl.float32)  # out^T tile: weight rows first, as the dot's A operand
        # With TWO a DOT iteration covers two BK tiles, loaded together: at BK = 128 each weight row is then
        # read in 128-byte pieces (whole cache lines, not halves) while the decode keeps its BK = 128 tiles.
        STEP: tl.constexpr = 2 * BK if TWO else BK
        if FAST_INT4 and PREFETCH:
            # The next iteration's words and scales (and activations) are loaded one iteration ahead, so a
            # program always has loads in flight while it decodes and multiplies. A row bound of 0 masks a
            # load past the program's last tile (no memory traffic).
            wa_next, sa_next = _load_packed(w_ptr, s_ptr, rows, k_lo, tl.where(k_lo < k_hi, N, 0), K, n_groups,
                                            stride_wn, stride_sn, FMT, BN, BK, GROUP, K_EVEN)  # fmt: skip
            if TWO:
                wb_next, sb_next = _load_packed(w_ptr, s_ptr, rows, k_lo + BK, tl.where(k_lo + BK < k_hi, N, 0), K,
                                                n_groups, stride_wn, stride_sn, FMT, BN, BK, GROUP, K_EVEN)  # fmt: skip
        # Everything above reads frozen weights only, so under PDL it overlaps the previous kernel's tail; the
        # activations (and every store) come after the wait.
        wait_for_producers(PDL)
        arrived = lora_arrive(lt, LORA)
        stamp(stamp_ptr, linear_program(), 4, STAMPS)
        if DOT and PREFETCH:
            xa_next = _load_x(x_ptr, m0, offs_m, m_ok, stride_xm, k_lo, k_hi, BM, BK, ONE_ROW)
            if TWO:
                xb_next = _load_x(x_ptr, m0, offs_m, m_ok, stride_xm, k_lo + BK, k_hi, BM, BK, ONE_ROW)
        for k0 in range(k_lo, k_hi, STEP):
            if FAST_INT4:
                if PREFETCH:
                    wa, sa = wa_next, sa_next
                    nxt = k0 + STEP
                    wa_next, sa_next = _load_packed(w_ptr, s_ptr, rows, nxt, tl.where(nxt < k_hi, N, 0), K, n_groups,
                                                    stride_wn, stride_sn, FMT, BN, BK, GROUP, K_EVEN)  # fmt: skip
                    if TWO:
                        wb, sb = wb_next, sb_next
                        n_b = tl.where(nxt + BK < k_hi, N, 0)
                        wb_next, sb_next = _load_packed(w_ptr, s_ptr, rows, nxt + BK, n_b, K, n_groups,
                                                        stride_wn, stride_sn, FMT, BN, BK, GROUP, K_EVEN)  # fmt: skip
                else:
                    wa, sa = _load_packed(w_ptr, s_ptr, rows, k0, N, K, n_groups, stride_wn, stride_sn,
                                          FMT, BN, BK, GROUP, K_EVEN)  # fmt: skip
                    if TWO:
                        wb, sb = _load_packed(w_ptr, s_ptr, rows, k0 + BK, tl.where(k0 + BK < k_hi, N, 0), K, n_groups,
                                              stride_wn, stride_sn, FMT, BN, BK, GROUP, K_EVEN)  # fmt: skip
                if DOT:
                    w = _int4_tile_mma(wa, sa, BN, BK, GROUP, FMT == 5)
                    if TWO:
                        w2 = _int4_tile_mma(wb, sb, BN, BK, GROUP, FMT == 5)
                else:
                    w = _int4_tile_f32(wa, sa, BN, BK, GROUP, FMT == 5)
            else:
                w = _generic_tile(w_ptr, s_ptr, rows, k0, N, K, n_groups, stride_wn, stride_sn, gscale,
                                  FMT, BN, BK, GROUP, K_EVEN, x_ptr.dtype.element_ty, DOT)  # fmt: skip
                if TWO:
                    w2 = _generic_tile(w_ptr, s_ptr, rows, k0 + BK, tl.where(k0 + BK < k_hi, N, 0), K, n_groups,
                                       stride_wn, stride_sn, gscale, FMT, BN, BK, GROUP, K_EVEN,
                                       x_ptr.dtype.element_ty, DOT)  # fmt: skip
            if DOT:
                if PREFETCH:  # activations one iteration ahead too (their L2 latency would stall the dot)
                    xa = xa_next
                    xa_next = _load_x(x_ptr, m0, offs_m, m_ok, stride_xm, k0 + STEP, k_hi, BM, BK, ONE_ROW)
                    if TWO:
                        xb = xb_next
                        xb_next = _load_x(x_ptr, m0, offs_m, m_ok, stride_xm, k0 + STEP + BK, k_hi, BM, BK, ONE_ROW)
                else:
                    xa = _load_x(x_ptr, m0, offs_m, m_ok, stride_xm, k0, k_hi, BM, BK, ONE_ROW)
                    if TWO:
                        xb = _load_x(x_ptr, m0, offs_m, m_ok, stride_xm, k0 + BK, k_hi, BM, BK, ONE_ROW)
                acc = _dot_step(w, xa, acc, BM, BK, ONE_ROW)
                if TWO:
                    acc = _dot_step(w2, xb, acc, BM, BK, ONE_ROW)
            else:
                cols = k0 + tl.arange(0, BK)
                acc = _fma_rows(w, x_ptr, m0, M, stride_xm, cols, cols < K, acc, BM)
        stamp(stamp_ptr, linear_program(), 5, STAMPS)
        store_out(acc, out_ptr, ws_ptr, cnt_ptr, pid_n, pid_m, split, offs_m, m_ok, M, N, n_splits, tl.cdiv(N, BN),
                   stride_om, lb0, lb1, lb2, ls0, ls1, ls2, lst1, lst2, lr, lt, arrived, BN, BM, SPLIT, BR,
                   LORA)  # fmt: skip
    lora_leave(lt, arrived, LORA)
    stamp(stamp_ptr, linear_program(), 6, STAMPS)  # (exit in cycles: tails on one clock, bench/gemv_timeline.py)
    stamp(stamp_ptr, linear_program(), 1, STAMPS)


# The descriptor variant (GemvConfig.tma, int4 only): words and scales arrive by TMA into shared memory,
# `stages` iterations ahead under the compiler's software pipeline, so a program keeps several tiles in
# flight with few registers and no address arithmetic; the boxes' zero fill replaces every mask.
@triton.jit(do_not_specialize=["M", "n_splits", "N_A", "lst1", "lst2", "lr", "lslices"])
def _gemv_tma_kernel(x_ptr, w_desc, s_desc, out_ptr, ws_ptr, cnt_ptr, M, N, K, k_per_split, n_splits,
                     stride_xm, stride_om, N_A, la0, la1, la2, lb0, lb1, lb2, ls0, ls1, ls2,
                     lst1, lst2, lr, lslices, lpart, lt, lcnt, stamp_ptr,
                     GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr, FAST_INT4: tl.constexpr, SPLIT: tl.constexpr, ONE_ROW: tl.constexpr,
                     STAGES: tl.constexpr, PDL: tl.constexpr, LORA: tl.constexpr, BR: tl.constexpr,
                     STAMPS: tl.constexpr):  # fmt: skip
    stamp(stamp_ptr, linear_program(), 0, STAMPS)
    wait_for_producers(PDL)
    arrived = lora_arrive(lt, LORA)
    stamp(stamp_ptr, linear_program(), 4, STAMPS)
    if LORA:
        pid_n, split, pid_m, is_rank = flat_program(N, n_splits, N_A, BN)
    else:
        pid_n, split, pid_m, is_rank = tl.program_id(0), tl.program_id(1), tl.program_id(2), False
    if is_rank:
        lora_rank_program(tl.program_id(0), x_ptr, M, K, stride_xm, la0, la1, la2, lr, lslices, lpart, lt, lcnt,
                          arrived, BM, BR, ONE_ROW)  # fmt: skip
    else:
        _tma_program(x_ptr, w_desc, s_desc, out_ptr, ws_ptr, cnt_ptr, M, N, K, k_per_split, n_splits, stride_xm,
                     stride_om, pid_n, split, pid_m, lb0, lb1, lb2, ls0, ls1, ls2, lst1, lst2, lr, lt, arrived,
                     GROUP, BM, BN, BK, FAST_INT4, SPLIT, ONE_ROW, STAGES, LORA, BR)  # fmt: skip
    lora_leave(lt, arrived, LORA)
    stamp(stamp_ptr, linear_program(), 6, STAMPS)  # (exit in cycles: tails on one clock, bench/gemv_timeline.py)
    stamp(stamp_ptr, linear_program(), 1, STAMPS)


@triton.jit
def _tma_program(x_ptr, w_desc, s_desc, out_ptr, ws_ptr, cnt_ptr, M, N, K, k_per_split, n_splits, stride_xm,
                 stride_om, pid_n, split, pid_m, lb0, lb1, lb2, ls0, ls1, ls2, lst1, lst2, lr, lt, arrived,
                 GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FAST_INT4: tl.constexpr,
                 SPLIT: tl.constexpr, ONE_ROW: tl.constexpr, STAGES: tl.constexpr, LORA: tl.constexpr,
                 BR: tl.constexpr):  # fmt: skip
    m0 = pid_m.to(tl.int64) * BM
    offs_m = m0 + tl.arange(0, BM)
    m_ok = offs_m < M
    k_lo = tl.multiple_of(split * k_per_split, BK)
    k_hi = min(k_lo + k_per_split, K)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BK, num_stages=STAGES):
        words = w_desc.load([pid_n * BN, k0 // 8])  # [BN, BK // 8] int32
        scales = s_desc.load([pid_n * BN, k0 // GROUP])  # [BN, BK // GROUP] bf16
        if FAST_INT4:
            w = _int4_tile_mma(words, scales, BN, BK, GROUP, False)  # (the TMA GEMV reads row-major int4 only)
        else:  # interpreter / fp16 / fp32: the generic decoder's values, in the dot's K order
            w = apply_scales(int4_values(words, BN, BK), scales.to(tl.float32), BN, BK, GROUP)
            w = _k_permute(w.to(x_ptr.dtype.element_ty), BN, BK)
        x = _load_x(x_ptr, m0, offs_m, m_ok, stride_xm, k0, k_hi, BM, BK, ONE_ROW)
        acc = _dot_step(w, x, acc, BM, BK, ONE_ROW)
    store_out(acc, out_ptr, ws_ptr, cnt_ptr, pid_n, pid_m, split, offs_m, m_ok, M, N, n_splits, tl.cdiv(N, BN),
               stride_om, lb0, lb1, lb2, ls0, ls1, ls2, lst1, lst2, lr, lt, arrived, BN, BM, SPLIT, BR,
               LORA)  # fmt: skip


def gemv(x: Tensor, w: PackedWeight, out: Tensor, cfg: GemvConfig, tickets, fast_int4: bool,
         lora: LoraDelta | None = None, stamps: Tensor | None = None) -> Tensor:  # fmt: skip
    """out[M, N] = x[M, K] @ W^T with the small-M kernel. x: [M, K] with unit stride along K; out: [M, N]
    contiguous; tickets(n) returns a zeroed int32 ticket buffer of at least n entries (gemm._tickets);
    fast_int4: decode int4 with the packed-bf16 PTX path (bf16 activations on the GPU only); lora: adapters
    added in the same launch (gemv_lora.py; `gemv_lora.fits` must hold); stamps: int64 [programs, timeline.SLOTS]
    that receives a per-program timeline (kernels/timeline.py; GPU only)."""
    if cfg.mma:
        rows_aligned = x.data_ptr() % 16 == 0 and (x.shape[0] == 1 or x.stride(0) % 8 == 0)
        if mma_ok(w, cfg) and x.shape[0] <= 16 and fast_int4 and rows_aligned:
            return gemv_mma(x, w, out, cfg, tickets, lora, stamps)
        cfg = next(c for bound, c in GEMV_TILES if x.shape[0] <= bound)  # e.g. rows off 16-byte boundaries
    m, k = x.shape
    n = w.n
    n_tiles = triton.cdiv(n, cfg.block_n)
    m_tiles = triton.cdiv(m, cfg.block_m)
    step = cfg.block_k * (2 if cfg.dot and cfg.two_tiles else 1)
    k_per_split = gemv_splits(cfg, n_tiles * m_tiles, k, x.device, step) * step
    split = triton.cdiv(k, k_per_split)
    n_tickets = n_tiles * m_tiles if split > 1 else 0
    cnt = tickets(n_tickets + (N_COUNTERS if lora is not None else 0)) if split > 1 or lora is not None else out
    ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out  # unused if 1
    launch = launch_args(x, n, lora, cfg.block_m, cfg.block_n, lambda: cnt[n_tickets:], n_tiles * split * m_tiles,
                         stamps)  # fmt: skip
    grid = (launch.rank_programs + n_tiles * split * m_tiles,) if lora is not None else (n_tiles, split, m_tiles)
    pdl = use_pdl(x.device)
    extra = launch.constexprs
    if cfg.tma and tma_ok(w, cfg):  # else the pointer kernel with the same tiles
        w_desc = TensorDescriptor.from_tensor(w.values, [cfg.block_n, cfg.block_k // 8])
        s_desc = TensorDescriptor.from_tensor(w.scale, [cfg.block_n, cfg.block_k // w.group])
        _gemv_tma_kernel[grid](
            x, w_desc, s_desc, out, ws, cnt, m, n, k, k_per_split, split, x.stride(0), out.stride(0), *launch.tail,
            GROUP=w.group, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, FAST_INT4=fast_int4,
            SPLIT=split > 1, ONE_ROW=m == 1, STAGES=cfg.num_stages, PDL=pdl, launch_pdl=pdl, num_warps=cfg.num_warps,
            **extra,
        )  # fmt: skip
        return out
    gs = w.global_scale if w.global_scale is not None else w.scale
    _gemv_kernel[grid](
        x, w.values, w.scale, gs, out, ws, cnt,
        m, n, k, w.scale.shape[-1], k_per_split, split,
        x.stride(0), w.values.stride(0), w.scale.stride(0), out.stride(0), *launch.tail,
        FMT=w.fmt.code, GROUP=w.group, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, DOT=cfg.dot,
        K_EVEN=k % cfg.block_k == 0, FAST_INT4=fast_int4, SPLIT=split > 1, PREFETCH=cfg.prefetch,
        ONE_ROW=m == 1, TWO=cfg.dot and cfg.two_tiles, PDL=pdl, launch_pdl=pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **cfg.launch_options,
        **extra,
    )  # fmt: skip
    return out
