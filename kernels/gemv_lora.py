"""LoRA inside the decode GEMV's launch: out = x W^T + scale_g * B_g (A_g x), up to three adapters side by side.

At batch 1 a LoRA linear was three launches (the GEMV, then `lora.py`'s down and up kernels), and the two LoRA
launches cost about as much as the GEMV of a small matrix: 64 of them took 176 us of a 1.15 ms Qwen3-8B step
(bench/RESULTS.md). Here the GEMV launch does it all:

- The grid's first programs are *rank programs*. Program (g, s) computes the fp32 partial x A_g[:, slice s]^T
  over one K slice: 256 wide by chained tensor-core dots, or at M = 1 128 wide on the FMA units with every load
  issued at once (a chain of dependent loads there cost more than the GEMV it rides in). The last of adapter
  g's rank programs (an atomic ticket) sums the partials in a fixed order, rounds t_g to the adapter dtype and
  publishes it as *tagged words*: 64 bits each, the fp32 value in the low half and the launch's tag in the high.
- The weight programs run as before. The program that writes an output tile (the tile's last split) polls its
  adapter's t words until every one carries this launch's tag, then adds scale_g * B_g[tile rows] t_g with the
  rounding steps of `lora.py`'s up kernel.

Why tags, not a flag: a flag then t is two dependent L2 round trips at the end of every output tile, and a flag
needs re-arming (a counted atomic at every program's exit, the last one clearing it). A 64-bit word is written and
read whole, so each word shows its own readiness: one round trip. The tag is the launch's epoch plus one, from a
per-stream state word (epoch << 32 | programs arrived): every program adds 1 after its PDL wait (which returns
the epoch off the critical path), and the launch's last arrival advances the epoch and clears the count. All
programs of a launch read one epoch, since it advances only once all have arrived, and until a launch writes
them the state's t words hold earlier launches' tags only.

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

from .buffers import stream_buffer
from .lora import _BK as SLICE  # K per rank program at M > 1: lora.py's down kernel's slices
from .lora import MAX_SEGMENTS, _pick

# Constants the jit functions read (Triton takes only constexpr globals).
_SLICE = tl.constexpr(SLICE)
SLICE_ONE_ROW = 128  # K per rank program at M = 1: its [16, 128] adapter tile loads at once in a one-warp program
_SLICE1 = tl.constexpr(SLICE_ONE_ROW)
_SUB = tl.constexpr(32)  # K per chained dot in a slice (M > 1): [16, 32] operand tiles for one warp
_G = tl.constexpr(MAX_SEGMENTS)
# Counters after the weight tiles' tickets (zeroed, re-armed by the kernel): one slice ticket per adapter.
N_COUNTERS = MAX_SEGMENTS
# The per-stream state (int64): word 0 = (epoch << 32) | programs arrived; then the tagged t words [G, 16, 64]
# (an M tile of at most 16 rows, a rank padded to at most 64).
MAX_BM, MAX_BR = 16, 64
STATE_WORDS = 1 + MAX_SEGMENTS * MAX_BM * MAX_BR
_LOW = tl.constexpr(0xFFFFFFFF)


class LoraDelta(NamedTuple):
    """Adapters adding onto one output: A_g [r, K], B_g [N_g, r] (columns side by side, in order), scale_g."""

    a: list[Tensor]
    b: list[Tensor]
    scale: list[float]


class LoraArgs(NamedTuple):
    """What the GEMV kernels take for a LoraDelta (see `lora_args`)."""

    args: tuple  # a0, a1, a2, b0, b1, b2, s0, s1, s2, start1, start2, rank, slices, partials, state, counters
    programs: int  # rank programs at the front of the grid
    block_r: int  # the rank padded to the dots' minimum (the kernels' BR)


def fits(delta: LoraDelta, x: Tensor, n: int, block_m: int, block_n: int) -> bool:
    """Whether the fused path takes `delta` for x [M, K] @ W^T [N]: at most MAX_SEGMENTS adapters of one rank and
    dtype whose outputs tile N on block_n boundaries (so every output tile has one adapter), M in one row tile."""
    a, b = delta.a, delta.b
    if not 1 <= len(a) <= MAX_SEGMENTS or len(b) != len(a) or len(delta.scale) != len(a):
        return False
    r, k = a[0].shape
    if x.shape[0] > block_m or r > MAX_BR or any(t.dtype != a[0].dtype for t in (*a, *b)):
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


def lora_state(device: torch.device) -> Tensor:
    """The stream's LoRA state (epoch, arrivals, tagged t words): one fixed buffer, so that every launch on the
    stream sees the epoch the last one left."""
    return stream_buffer("lora_state", device, STATE_WORDS, torch.int64)


def rank_slices(m: int, k: int, slice_one_row: int = SLICE_ONE_ROW) -> int:
    """Rank programs per adapter for x [m, k]: K slices of slice_one_row at M = 1, of SLICE otherwise."""
    return triton.cdiv(k, slice_one_row if m == 1 else SLICE)


def lora_args(delta: LoraDelta, m: int, block_m: int, counters: Tensor, device: torch.device,
              slice_one_row: int = SLICE_ONE_ROW) -> LoraArgs:
    """Kernel arguments for `delta` (checked by `fits`) for M = m rows under a GEMV config of block_m (<= 16)
    rows; counters: N_COUNTERS zeroed int32 (re-armed by the kernel); slice_one_row: K per rank program at M = 1
    (the kernel's SLICE1)."""
    if block_m > MAX_BM:
        raise ValueError(f"fused LoRA: M tiles of at most {MAX_BM} rows, got {block_m}")
    a = [t.contiguous() for t in delta.a]
    b = [t.contiguous() for t in delta.b]
    g, (r, k) = len(a), a[0].shape
    pad = MAX_SEGMENTS - g
    starts = _starts(b)[1:g] + [1 << 30] * pad  # adapters 1 and 2's first rows; absent ones start past any row
    br = max(16, triton.next_power_of_2(r))
    slices = rank_slices(m, k, slice_one_row)
    partials = torch.empty((g, slices, block_m, br), dtype=torch.float32, device=device)
    args = (*a, *a[:1] * pad, *b, *b[:1] * pad, *map(float, delta.scale), *[0.0] * pad, *starts, r, slices,
            partials, lora_state(device), counters)  # fmt: skip
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
def lora_arrive(state, LORA: tl.constexpr):
    """Count this program into the launch (after its PDL wait); returns the state word before: the epoch in the
    high half, the programs counted before this one in the low. Nothing waits on it until the epilogue."""
    if LORA:
        return tl.atomic_add(state, 1, sem="relaxed")
    else:
        return tl.zeros((), tl.int64)


@triton.jit
def lora_leave(state, arrived, LORA: tl.constexpr):
    """The launch's last program to arrive advances the epoch and clears the count (every program has its
    epoch by then; the next launch reads the state only after this one completes)."""
    if LORA:
        total = tl.num_programs(0).to(tl.int64)
        if (arrived & _LOW) == total - 1:
            tl.atomic_add(state, tl.full((), 1 << 32, tl.int64) - total, sem="relaxed")


@triton.jit
def _t_words(state, seg, rows, ranks, BM: tl.constexpr, BR: tl.constexpr):
    """Pointers to adapter seg's tagged t words at (rows, ranks) of the state."""
    return state + 1 + seg * (BM * BR) + rows * BR + ranks


@triton.jit
def lora_rank_program(pid, x_ptr, M, K, stride_xm, a0, a1, a2, R, slices, part_ptr, state, cnt_ptr, arrived,
                      BM: tl.constexpr, BR: tl.constexpr, ONE_ROW: tl.constexpr,
                      SLICE1: tl.constexpr = _SLICE1):  # fmt: skip
    """Rank program `pid`: adapter g = pid // slices, K slice s = pid % slices (see the module docstring); SLICE1:
    K per slice at M = 1 (wider for programs of several warps, so that fewer of them take SM slots); arrived:
    lora_arrive's word."""
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
        t = t.to(a_ptr.dtype.element_ty).to(tl.float32)  # t rounded to the adapter dtype, carried exactly in fp32
        bits = t.to(tl.int32, bitcast=True).to(tl.int64) & _LOW
        tag = (arrived >> 32) + 1
        t_rows = tl.arange(0, 1 if ONE_ROW else BM)
        # Whole 64-bit words (atomics: single-copy atomic), so a poller sees each word either old or new.
        tl.atomic_xchg(_t_words(state, seg, t_rows[:, None], ranks[None, :], BM, BR), bits | (tag << 32),
                       sem="relaxed")  # fmt: skip
        tl.atomic_xchg(cnt_ptr + seg, 0)  # re-arm the slice ticket


@triton.jit
def lora_finish_tile(y, n0, offs_n, M, N, b0, b1, b2, scale0, scale1, scale2, start1, start2, R, state, arrived,
                     BN: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr):  # fmt: skip
    """The out^T tile [BN, BM] of rows offs_n (from n0): the base y, already rounded to the output dtype, plus
    (scale * round(B t)) rounded to it, the rounding steps of `lora.py`'s up kernel; arrived: lora_arrive's
    word, whose epoch names the t words of this launch."""
    seg = (n0 >= start1).to(tl.int32) + (n0 >= start2).to(tl.int32)
    b_ptr = _pick(seg, b0, b1, b2)
    scale = _pick(seg, scale0, scale1, scale2)
    start = _pick(seg, start1 * 0, start1, start2)
    ranks = tl.arange(0, BR)
    rows = offs_n - start
    b = tl.load(b_ptr + rows[:, None] * R + ranks[None, :], mask=(offs_n[:, None] < N) & (ranks[None, :] < R),
                other=0.0)  # fmt: skip
    m = tl.arange(0, BM)
    ptrs = _t_words(state, seg, m[None, :], ranks[:, None], BM, BR)  # [BR, BM]: t transposed, as the dot takes it
    live = (m < M)[None, :] & (ranks < BR)[:, None]
    tag = (arrived >> 32) + 1
    words = tl.load(ptrs, mask=live, other=0, volatile=True)
    while tl.min(tl.reshape(((words >> 32) == tag) | ~live, (BR * BM,)).to(tl.int32), axis=0) == 0:
        words = tl.load(ptrs, mask=live, other=0, volatile=True)  # one round trip per poll
    t = (words & _LOW).to(tl.int32).to(tl.float32, bitcast=True).to(b.dtype)
    delta = tl.dot(b, t)  # [BN, BM] fp32: B t for each output row and activation row
    delta = (delta.to(b.dtype).to(tl.float32) * scale).to(y.dtype)
    return y + delta
