"""LoRA inside the decode GEMV's launch: out = x W^T + scale_g * B_g (A_g x), up to three adapters side by side.

At batch 1 a LoRA linear was three launches (the GEMV, then `lora.py`'s down and up kernels), and the two LoRA
launches cost about as much as the GEMV of a small matrix: 64 of them took 176 us of a 1.15 ms Qwen3-8B step
(bench/RESULTS.md). Here the GEMV launch does it all:

- The grid's first programs are *rank programs*. Program (g, s) computes the fp32 partial x A_g[:, slice s]^T
  over one K slice: 256 wide by chained tensor-core dots, or at M = 1 128 wide on the FMA units with every load
  issued at once (a chain of dependent loads there cost more than the GEMV it rides in). The last of adapter
  g's rank programs (an atomic ticket) sums the partials in a fixed order, rounds t_g to the adapter dtype and
  raises adapter g's flag.
- The weight programs run as before. The program that writes an output tile (the tile's last split) waits for
  its adapter's flag, then adds scale_g * B_g[tile rows] t_g with the rounding steps of `lora.py`'s up kernel.
- The last tile written re-arms the flags for the next launch.

The wait is safe because the rank programs come first in the grid: a GPU dispatches programs in linear order,
so a waiting weight program implies every rank program is running or done (the forward-progress assumption of
decoupled look-back scans). Triton's interpreter runs programs in that order too.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from .lora import _BK as SLICE  # K per rank program at M > 1: lora.py's down kernel's slices
from .lora import MAX_SEGMENTS, _pick

# Constants the jit functions read (Triton takes only constexpr globals).
_SLICE = tl.constexpr(SLICE)
SLICE_ONE_ROW = 128  # K per rank program at M = 1: its [16, 128] adapter tile loads at once in a one-warp program
_SLICE1 = tl.constexpr(SLICE_ONE_ROW)
_SUB = tl.constexpr(32)  # K per chained dot in a slice (M > 1): [16, 32] operand tiles for one warp
_G = tl.constexpr(MAX_SEGMENTS)
# Counters after the weight tiles' tickets: [slice tickets G][flags G][tiles written 1].
N_COUNTERS = 2 * MAX_SEGMENTS + 1


class LoraDelta(NamedTuple):
    """Adapters adding onto one output: A_g [r, K], B_g [N_g, r] (columns side by side, in order), scale_g."""

    a: list[Tensor]
    b: list[Tensor]
    scale: list[float]


class LoraArgs(NamedTuple):
    """What the GEMV kernels take for a LoraDelta (see `lora_args`)."""

    args: tuple  # a0, a1, a2, b0, b1, b2, s0, s1, s2, start1, start2, rank, slices, partials, t, counters
    programs: int  # rank programs at the front of the grid
    block_r: int  # the rank padded to the dots' minimum (the kernels' BR)


def fits(delta: LoraDelta, x: Tensor, n: int, block_m: int, block_n: int) -> bool:
    """Whether the fused path takes `delta` for x [M, K] @ W^T [N]: at most MAX_SEGMENTS adapters of one rank and
    dtype whose outputs tile N on block_n boundaries (so every output tile has one adapter), M in one row tile."""
    a, b = delta.a, delta.b
    if not 1 <= len(a) <= MAX_SEGMENTS or len(b) != len(a) or len(delta.scale) != len(a):
        return False
    r, k = a[0].shape
    if x.shape[0] > block_m or r > 64 or any(t.dtype != a[0].dtype for t in (*a, *b)):
        return False
    if any(ag.shape != (r, k) or bg.dim() != 2 or bg.shape[1] != r for ag, bg in zip(a, b)):
        return False
    starts = _starts(b)
    return starts[-1] == n and all(s % block_n == 0 for s in starts[1:-1]) and x.shape[1] == k


def _starts(b: list[Tensor]) -> list[int]:
    """Each adapter's first output column, then the total: [0, N_0, N_0 + N_1, ..., sum N_g]."""
    starts = [0]
    for bg in b:
        starts.append(starts[-1] + bg.shape[0])
    return starts


def lora_args(delta: LoraDelta, m: int, block_m: int, counters: Tensor, device: torch.device,
              slice_one_row: int = SLICE_ONE_ROW) -> LoraArgs:
    """Kernel arguments for `delta` (checked by `fits`) for M = m rows under a GEMV config of block_m rows;
    counters: N_COUNTERS zeroed int32 (re-armed by the kernel); slice_one_row: K per rank program at M = 1 (the
    kernel's SLICE1)."""
    a = [t.contiguous() for t in delta.a]
    b = [t.contiguous() for t in delta.b]
    g, (r, k) = len(a), a[0].shape
    pad = MAX_SEGMENTS - g
    starts = _starts(b)[1:g] + [1 << 30] * pad  # adapters 1 and 2's first rows; absent ones start past any row
    br = max(16, triton.next_power_of_2(r))
    slices = triton.cdiv(k, slice_one_row if m == 1 else SLICE)
    partials = torch.empty((g, slices, block_m, br), dtype=torch.float32, device=device)
    t = torch.empty((g, block_m, br), dtype=a[0].dtype, device=device)
    args = (*a, *a[:1] * pad, *b, *b[:1] * pad, *map(float, delta.scale), *[0.0] * pad, *starts, r, slices,
            partials, t, counters)  # fmt: skip
    return LoraArgs(args, g * slices, br)


@triton.jit
def _sum_partials(base, slices, M, BM: tl.constexpr, BR: tl.constexpr, ONE_ROW: tl.constexpr):
    """Sum over s < slices of the fp32 tiles base[s] ([BM, BR], rows < M), in a fixed order; several slices per
    round of independent loads (one L2 round trip each), all of them at once for K <= 8192 at M = 1."""
    ROWS: tl.constexpr = 1 if ONE_ROW else BM
    PER: tl.constexpr = 64 if ONE_ROW else 4
    sl = tl.arange(0, PER)
    tile = tl.arange(0, ROWS)[:, None] * BR + tl.arange(0, BR)[None, :]
    row_ok = (tl.arange(0, ROWS) < M)[None, :, None]
    t = tl.zeros((ROWS, BR), dtype=tl.float32)
    for s0 in range(0, slices, PER):
        ptrs = base + (s0 + sl)[:, None, None] * (BM * BR) + tile[None, :, :]
        t += tl.sum(tl.load(ptrs, mask=((s0 + sl) < slices)[:, None, None] & row_ok, other=0.0,
                            cache_modifier=".cg"), axis=0)  # fmt: skip
    return t


@triton.jit
def lora_rank_program(pid, x_ptr, M, K, stride_xm, a0, a1, a2, R, slices, part_ptr, t_ptr, cnt_ptr,
                      BM: tl.constexpr, BR: tl.constexpr, ONE_ROW: tl.constexpr,
                      SLICE1: tl.constexpr = _SLICE1):  # fmt: skip
    """Rank program `pid`: adapter g = pid // slices, K slice s = pid % slices (see the module docstring); SLICE1:
    K per slice at M = 1 (wider for programs of several warps, so that fewer of them take SM slots)."""
    seg = pid // slices
    s = pid % slices
    a_ptr = _pick(seg, a0, a1, a2)
    rows = tl.arange(0, BM)
    ranks = tl.arange(0, BR)
    tile = rows[:, None] * BR + ranks[None, :]
    if ONE_ROW:  # M = 1: products on the FMA units, every load of the slice issued at once (one DRAM round trip)
        ks = s * SLICE1 + tl.arange(0, SLICE1)
        a = tl.load(a_ptr + ranks[:, None] * K + ks[None, :], mask=(ranks[:, None] < R) & (ks[None, :] < K),
                    other=0.0)  # fmt: skip
        x = tl.load(x_ptr + ks, mask=ks < K, other=0.0).to(a.dtype)
        part1 = tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)  # [BR]
        tl.store(part_ptr + (seg * slices + s) * BM * BR + ranks, part1)
    else:
        part = tl.zeros((BM, BR), dtype=tl.float32)
        for k0 in tl.static_range(0, _SLICE, _SUB):  # one dot over the slice, as chained mma steps in K order
            ks = s * _SLICE + k0 + tl.arange(0, _SUB)
            a = tl.load(a_ptr + ranks[:, None] * K + ks[None, :], mask=(ranks[:, None] < R) & (ks[None, :] < K),
                        other=0.0)  # fmt: skip
            x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :],
                        mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)  # fmt: skip
            part = tl.dot(x.to(a.dtype), tl.trans(a), part)
        tl.store(part_ptr + (seg * slices + s) * BM * BR + tile, part, mask=rows[:, None] < M)
    tl.debug_barrier()  # every thread's partial precedes the ticket (as gemv_out.store_out's split tail)
    ticket = tl.atomic_add(cnt_ptr + seg, 1, sem="acq_rel")
    if ticket == slices - 1:
        t = _sum_partials(part_ptr + seg * slices * BM * BR, slices, M, BM, BR, ONE_ROW)
        t_rows = tl.arange(0, 1 if ONE_ROW else BM)
        tl.store(t_ptr + seg * BM * BR + t_rows[:, None] * BR + ranks[None, :], t.to(t_ptr.dtype.element_ty))
        tl.atomic_xchg(cnt_ptr + seg, 0)
        tl.debug_barrier()
        tl.atomic_xchg(cnt_ptr + _G + seg, 1, sem="release")


@triton.jit
def lora_finish_tile(y, n0, offs_n, M, N, n_writers, b0, b1, b2, scale0, scale1, scale2, start1, start2, R, t_ptr,
                     cnt_ptr, BN: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr):  # fmt: skip
    """The out^T tile [BN, BM] of rows offs_n (from n0): the base y, already rounded to the output dtype, plus
    (scale * round(B t)) rounded to it, the rounding steps of `lora.py`'s up kernel."""
    seg = (n0 >= start1).to(tl.int32) + (n0 >= start2).to(tl.int32)
    b_ptr = _pick(seg, b0, b1, b2)
    scale = _pick(seg, scale0, scale1, scale2)
    start = _pick(seg, start1 * 0, start1, start2)
    ranks = tl.arange(0, BR)
    rows = offs_n - start
    b = tl.load(b_ptr + rows[:, None] * R + ranks[None, :], mask=(offs_n[:, None] < N) & (ranks[None, :] < R),
                other=0.0)  # fmt: skip
    flag = cnt_ptr + _G + seg
    while tl.atomic_add(flag, 0, sem="acquire") == 0:  # one round trip per poll, ordering the reads of t after it
        pass
    m = tl.arange(0, BM)
    t = tl.load(t_ptr + seg * BM * BR + m[None, :] * BR + ranks[:, None], mask=(m < M)[None, :], other=0.0,
                cache_modifier=".cg")  # fmt: skip
    delta = tl.dot(b, t)  # [BN, BM] fp32: B t for each output row and activation row
    delta = (delta.to(b.dtype).to(tl.float32) * scale).to(y.dtype)
    return y + delta


@triton.jit
def lora_tile_written(cnt_ptr, n_writers):
    """Count a written output tile; the last one re-arms the flags (every waiter has passed its flag by then, its
    acquire ordering its count after the read: a relaxed count suffices and costs no fence)."""
    written = tl.atomic_add(cnt_ptr + 2 * _G, 1, sem="relaxed")
    if written == n_writers - 1:
        for g in tl.static_range(_G):
            tl.atomic_xchg(cnt_ptr + _G + g, 0, sem="relaxed")
        tl.atomic_xchg(cnt_ptr + 2 * _G, 0, sem="relaxed")
