"""Fused dequant-GEMM for one packed weight W [N, K]: forward y = x W^T and dX dx = dy W.

One kernel body serves both: it computes out[M, P] = a[M, R] @ B[R, P] where B is W^T (forward,
P = N, R = K) or W (dX, P = K, R = N). Weight tiles are always read in W's stored orientation and
decoded in registers (dequant.dequant_tile); bf16 weights never reach HBM and dX needs no second copy.
Accumulation is fp32. Small M uses a deterministic split-K: each split writes an fp32 partial and the
last program to finish a tile (counted with an atomic ticket) sums the partials in split order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import configs
from .buffers import stream_buffer
from .configs import TileConfig, auto_split, fuse_lora, pick_config, pick_gemv, split_evenly
from .dequant import dequant_tile, load_scales
from .emulate import INTERPRETED
from .formats import PLAIN, PackedWeight
from .gemv import gemv
from .gemv_lora import LoraDelta, fits
from .lora import lora_add_many
from .mode import is_batch_invariant
from .wgmma_int4 import supports as wgmma_supports
from .wgmma_int4 import wgmma_int4


@triton.jit
def tile_mainloop(a_ptr, stride_am, stride_ar, offs_m, m_ok, w_ptr, s_ptr, gs_ptr, stride_wn, stride_sn,
                  p0, r_lo, r_hi, R, N, K, n_groups,
                  FMT: tl.constexpr, GROUP: tl.constexpr, DX: tl.constexpr, SWAP: tl.constexpr,
                  BM: tl.constexpr, BP: tl.constexpr, BR: tl.constexpr, PREC: tl.constexpr,
                  K_EVEN: tl.constexpr, FAST_INT4: tl.constexpr):
    """fp32 accumulator of a[offs_m, r_lo:r_hi] @ B[r_lo:r_hi, p0:p0+BP]; [BP, BM] if SWAP else [BM, BP].

    r_lo is a multiple of BR, so weight tiles stay aligned to scale groups.
    """
    offs_p = p0 + tl.arange(0, BP)
    if SWAP:
        acc = tl.zeros((BP, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BP), dtype=tl.float32)
    a_rows = a_ptr + offs_m * stride_am
    if FMT == 3:
        gscale = tl.load(gs_ptr)
    else:
        gscale = 1.0
    # Scales are too small per row for async copies, so the next tile's scales are prefetched by hand
    # into registers one iteration ahead; that hides their load latency behind this tile's MMA.
    # A row bound of 0 masks a prefetch that has no tile to serve (and would read past the scales).
    n_first = tl.where(r_lo < r_hi, N, 0)
    if DX:  # B = W: rows are the reduction (N), columns the output (K)
        s_next = load_scales(s_ptr, r_lo + tl.arange(0, BR), p0, n_first, n_groups, stride_sn, gscale,
                             FMT, BR, BP, GROUP, K_EVEN)
    else:  # B = W^T: the tile W[offs_p, r0:r0+BR] is read row-major and transposed in registers
        s_next = load_scales(s_ptr, offs_p, r_lo, n_first, n_groups, stride_sn, gscale,
                             FMT, BP, BR, GROUP, K_EVEN)
    for r0 in range(r_lo, r_hi, BR):
        offs_r = r0 + tl.arange(0, BR)
        r_ok = offs_r < R
        scales = s_next
        n_next = tl.where(r0 + BR < r_hi, N, 0)
        if DX:
            s_next = load_scales(s_ptr, offs_r + BR, p0, n_next, n_groups, stride_sn, gscale,
                                 FMT, BR, BP, GROUP, K_EVEN)
            wt = dequant_tile(w_ptr, scales, offs_r, p0, N, K, stride_wn, FMT, BR, BP, GROUP, K_EVEN, FAST_INT4)
        else:
            s_next = load_scales(s_ptr, offs_p, r0 + BR, n_next, n_groups, stride_sn, gscale,
                                 FMT, BP, BR, GROUP, K_EVEN)
            wt = dequant_tile(w_ptr, scales, offs_p, r0, N, K, stride_wn, FMT, BP, BR, GROUP, K_EVEN, FAST_INT4)
        wt = wt.to(a_ptr.dtype.element_ty)
        if SWAP:
            a_t = tl.load(a_rows[None, :] + offs_r[:, None] * stride_ar,
                          mask=m_ok[None, :] & r_ok[:, None], other=0.0)
            if DX:
                acc = tl.dot(tl.trans(wt), a_t, acc, input_precision=PREC)
            else:
                acc = tl.dot(wt, a_t, acc, input_precision=PREC)
        else:
            a = tl.load(a_rows[:, None] + offs_r[None, :] * stride_ar,
                        mask=m_ok[:, None] & r_ok[None, :], other=0.0)
            if DX:
                acc = tl.dot(a, wt, acc, input_precision=PREC)
            else:
                acc = tl.dot(a, tl.trans(wt), acc, input_precision=PREC)
    return acc


@triton.jit
def tile_ptrs(base, offs_m, offs_p, m_ok, P, stride_om, stride_op, SWAP: tl.constexpr):
    """Pointers and mask of an output tile laid out like the accumulator ([BP, BM] when SWAP)."""
    if SWAP:
        ptrs = base + offs_p[:, None] * stride_op + offs_m[None, :] * stride_om
        mask = (offs_p[:, None] < P) & m_ok[None, :]
    else:
        ptrs = base + offs_m[:, None] * stride_om + offs_p[None, :] * stride_op
        mask = m_ok[:, None] & (offs_p[None, :] < P)
    return ptrs, mask


# M is never specialized (Triton would compile M == 1 and M % 16 == 0 separately), so one binary serves
# every batch size: batch-invariant mode relies on identical code, not just identical tiles.
@triton.jit(do_not_specialize=["M", "n_splits"])
def _dense_kernel(a_ptr, w_ptr, s_ptr, gs_ptr, out_ptr, ws_ptr, cnt_ptr,
                  M, P, R, N, K, n_groups, r_per_split, n_splits,
                  stride_am, stride_ar, stride_wn, stride_sn, stride_om, stride_op,
                  FMT: tl.constexpr, GROUP: tl.constexpr, DX: tl.constexpr, SWAP: tl.constexpr,
                  SPLIT: tl.constexpr, BM: tl.constexpr, BP: tl.constexpr, BR: tl.constexpr,
                  GROUP_M: tl.constexpr, PREC: tl.constexpr, K_EVEN: tl.constexpr, FAST_INT4: tl.constexpr):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_m = tl.cdiv(M, BM)
    num_p = tl.cdiv(P, BP)
    # Walk GROUP_M row-tiles per column sweep so concurrently running programs share weight tiles in L2.
    width = GROUP_M * num_p
    first_m = (pid // width) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_p = (pid % width) // size_m

    offs_m = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
    m_ok = offs_m < M
    offs_p = pid_p * BP + tl.arange(0, BP)
    # r_per_split is a multiple of BR; saying so lets Triton prove the packed-word and scale addresses
    # aligned, so their loads become pipelined async copies instead of stalling every iteration.
    r_lo = tl.multiple_of(split * r_per_split, BR)
    r_hi = min(r_lo + r_per_split, R)
    acc = tile_mainloop(a_ptr, stride_am, stride_ar, offs_m, m_ok, w_ptr, s_ptr, gs_ptr, stride_wn, stride_sn,
                        pid_p * BP, r_lo, r_hi, R, N, K, n_groups, FMT, GROUP, DX, SWAP, BM, BP, BR, PREC,
                        K_EVEN, FAST_INT4)
    if not SPLIT:
        ptrs, mask = tile_ptrs(out_ptr, offs_m, offs_p, m_ok, P, stride_om, stride_op, SWAP)
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # Partials live in ws [n_splits, M, P] fp32. The barrier makes every thread's partial store
        # precede the (single-thread) ticket, whose acq_rel ordering publishes them to the last arriver.
        ws_ptrs, ws_mask = tile_ptrs(ws_ptr + split.to(tl.int64) * M * P, offs_m, offs_p, m_ok, P, P, 1, SWAP)
        tl.store(ws_ptrs, acc, mask=ws_mask)
        tl.debug_barrier()
        ticket = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel")
        if ticket == n_splits - 1:
            total = tl.zeros(acc.shape, dtype=tl.float32)
            part_ptrs, part_mask = tile_ptrs(ws_ptr, offs_m, offs_p, m_ok, P, P, 1, SWAP)
            for _ in range(n_splits):  # fixed order: the sum does not depend on arrival order
                total += tl.load(part_ptrs, mask=part_mask, other=0.0, cache_modifier=".cg")
                part_ptrs += M * P
            out_ptrs, out_mask = tile_ptrs(out_ptr, offs_m, offs_p, m_ok, P, stride_om, stride_op, SWAP)
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(cnt_ptr + pid, 0)  # re-arm the ticket for the next launch


_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _tickets(device: torch.device, n: int) -> Tensor:
    """Zeroed int32 split-K tickets, one buffer per (device, stream); each kernel re-zeroes what it used."""
    return stream_buffer("tickets", device, max(n, 1024), torch.int32)


def check_activation(a: Tensor, w: PackedWeight, dx: bool, what: str) -> None:
    if a.dtype not in _ACT_DTYPES:
        raise TypeError(f"{what} must be bf16, fp16 or fp32, got {a.dtype}")
    if a.device != w.values.device:
        raise ValueError(f"{what} is on {a.device} but the packed weight is on {w.values.device}")
    want = w.n if dx else w.k
    if a.shape[-1] != want:
        dim = "N" if dx else "K"
        raise ValueError(
            f"{what} has last dim {a.shape[-1]} but the {w.fmt.name} weight [N={w.n}, K={w.k}] "
            f"needs {dim}={want}"
        )


def k_even(w: PackedWeight, cfg: TileConfig, dx: bool) -> bool:
    """Whether K is a multiple of the tile's K extent (block_p for dX, block_r forward)."""
    return w.k % (cfg.block_p if dx else cfg.block_r) == 0


def fast_int4(w: PackedWeight, dtype: torch.dtype) -> bool:
    """Whether to decode int4 with the packed-bf16 PTX path (bf16 activations, compiled kernels only)."""
    return configs.FAST_INT4 and w.int4 and dtype == torch.bfloat16 and not INTERPRETED


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 activations ask for true fp32 products; Triton would otherwise use tf32 tensor cores.
    return "ieee" if dtype == torch.float32 else "tf32"


def wgmma_serves(a2: Tensor, w: PackedWeight) -> bool:
    """Whether dense_gemm's forward of the rows a2 [M, K] runs wgmma_int4: int4 on bf16 on Hopper, the switch on,
    outside batch-invariant mode, rows and layouts wgmma_int4.supports."""
    return configs.WGMMA_INT4 and fast_int4(w, a2.dtype) and not is_batch_invariant() and wgmma_supports(a2, w)


def dense_gemm(a: Tensor, w: PackedWeight, dx: bool, config: TileConfig | None = None,
               lora: LoraDelta | None = None) -> Tensor:
    """out = a @ W^T (forward) or a @ W (dx=True), W dequantized in-kernel; plus, for a forward of at most
    lora.MAX_ROWS rows, the adapters' deltas `lora` (in the decode GEMV's own launch where they fit).

    a: [..., K] (forward) or [..., N] (dX), bf16/fp16/fp32; returns [..., N] or [..., K] in a.dtype.
    """
    if lora is not None and dx:
        raise ValueError("dense_gemm: LoRA deltas apply to the forward only")
    if w.experts is not None:
        raise ValueError("dense_gemm takes one matrix; use grouped_gemm for stacked experts")
    check_activation(a, w, dx, "dy" if dx else "x")
    lead = a.shape[:-1]
    a2 = a.reshape(-1, a.shape[-1])
    m, r = a2.shape
    p = w.k if dx else w.n
    out = torch.empty((m, p), dtype=a.dtype, device=a.device)
    if m == 0:
        return out.reshape(*lead, p)
    if r == 0:
        return out.zero_().reshape(*lead, p)
    gcfg = None
    if config is None and not dx and w.fmt.code != PLAIN:
        # Decode sizes: the bandwidth-bound small-M kernel (never in batch-invariant mode, which keeps
        # its one fixed tile config for every M; pick_gemv returns None there).
        packed_int4 = fast_int4(w, a.dtype)
        gcfg = pick_gemv(m, a.device, a.dtype, packed_int4, w)
    if config is None and not dx and not (gcfg and gcfg.mma) and wgmma_serves(a2, w):
        # 9 to wgmma_int4.MAX_ROWS rows of int4 on bf16, on Hopper: the warpgroup-MMA kernel (wgmma_int4.py), LoRA
        # added after it. At 9-16 rows it beats the decode GEMVs even with the GEMV's LoRA in its launch
        # (bench/RESULTS.md, thirteenth session), but for the small weights the mma GEMV takes (configs.pick_gemv);
        # past 64, the tile kernel and dequantize + cuBLAS (sixteenth).
        out = wgmma_int4(a2, w, out, lambda n: _tickets(a.device, n))
        if lora is not None:
            out = lora_add_many(out, a2, *lora)
        return out.reshape(*lead, p)
    if gcfg is not None:
        a2 = a2 if a2.stride(1) == 1 else a2.contiguous()
        fused = lora is not None and fuse_lora(m, r, gcfg) and fits(lora, a2, p, gcfg.block_m, gcfg.block_n)
        gemv(a2, w, out, gcfg, lambda n: _tickets(a.device, n), packed_int4, lora if fused else None)
        if lora is not None and not fused:
            out = lora_add_many(out, a2, *lora)
        return out.reshape(*lead, p)
    cfg = config or pick_config("dx" if dx else "fwd", m, a.device, a.dtype, r if fast_int4(w, a.dtype) else 0)
    n_tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(p, cfg.block_p)
    split = auto_split(cfg, n_tiles, r, a.device)
    r_per_split, split = split_evenly(r, split, cfg.block_r)
    if split > 1:
        ws = torch.empty((split, m, p), dtype=torch.float32, device=a.device)
        tickets = _tickets(a.device, n_tiles)
    else:
        ws = tickets = out  # unused by the kernel without a split
    gs = w.global_scale if w.global_scale is not None else w.scale
    _dense_kernel[(n_tiles, split)](
        a2, w.values, w.scale, gs, out, ws, tickets,
        m, p, r, w.n, w.k, w.scale.shape[-1], r_per_split, split,
        a2.stride(0), a2.stride(1), w.values.stride(0), w.scale.stride(0), out.stride(0), out.stride(1),
        FMT=w.fmt.code, GROUP=w.group, DX=dx, SWAP=cfg.swap_ab, SPLIT=split > 1,
        BM=cfg.block_m, BP=cfg.block_p, BR=cfg.block_r, GROUP_M=cfg.group_m, PREC=dot_precision(a.dtype),
        K_EVEN=k_even(w, cfg, dx), FAST_INT4=fast_int4(w, a.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if lora is not None:
        out = lora_add_many(out, a2, *lora)
    return out.reshape(*lead, p)
