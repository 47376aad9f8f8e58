"""The decode GEMVs' shared epilogue: where a program sits in a LoRA launch's flat grid, and how an output tile is
written (directly, or summed over split-K partials by the tile's last program), with the LoRA delta added in the
same launch (gemv_lora.py). Used by gemv.py's kernels and gemv_mma.py's."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from .gemv_lora import SLICE_ONE_ROW, LoraDelta, fits, lora_args, lora_finish_tile
from .timeline import check_stamps


@triton.jit
def flat_program(N, n_splits, N_A, BN: tl.constexpr):
    """(pid_n, split, pid_m, is_rank) in a LoRA launch's flat grid: N_A rank programs first (gemv_lora.py), then the
    weight programs, N tiles fastest. (Without LoRA the grid is (N tiles, splits, M tiles) and is_rank a constant
    False: the rank branch is dead code, though Triton still type-checks it, hence gemv()'s typed placeholders.)"""
    q = tl.maximum(tl.program_id(0) - N_A, 0)
    n_tiles = tl.cdiv(N, BN)
    return q % n_tiles, (q // n_tiles) % n_splits, q // (n_tiles * n_splits), tl.program_id(0) < N_A


@triton.jit
def _emit(val, out_ptrs, mask, pid_n, offs_n, M, N, lb0, lb1, lb2, ls0, ls1, ls2, lst1, lst2, lr, lstate, arrived,
          BN: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr, LORA: tl.constexpr):
    """Store the finished out^T tile (fp32), with its LoRA delta added when LORA (gemv_lora.py)."""
    y = val.to(out_ptrs.dtype.element_ty)
    if LORA:
        y = lora_finish_tile(y, pid_n * BN, offs_n, M, N, lb0, lb1, lb2, ls0, ls1, ls2, lst1, lst2, lr, lstate,
                             arrived, BN, BM, BR)  # fmt: skip
    tl.store(out_ptrs, y, mask=mask)


@triton.jit
def store_out(acc, out_ptr, ws_ptr, cnt_ptr, pid_n, pid_m, split, offs_m, m_ok, M, N, n_splits, n_tiles, stride_om,
              lb0, lb1, lb2, ls0, ls1, ls2, lst1, lst2, lr, lstate, arrived,
              BN: tl.constexpr, BM: tl.constexpr, SPLIT: tl.constexpr, BR: tl.constexpr, LORA: tl.constexpr):
    """Write the out^T tile acc[BN, BM]: directly, or (SPLIT) as split `split`'s fp32 partial, the last
    program of the output tile summing all partials in split order. n_tiles: output tiles along N; lstate,
    arrived: the LoRA state and the program's gemv_lora.lora_arrive word."""
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask = (offs_n[:, None] < N) & m_ok[None, :]
    out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    if not SPLIT:
        _emit(acc, out_ptrs, mask, pid_n, offs_n, M, N, lb0, lb1, lb2, ls0, ls1, ls2, lst1, lst2, lr, lstate, arrived,
              BN, BM, BR, LORA)  # fmt: skip
    else:
        # Partials live in ws [n_splits, M, N] fp32. The barrier makes every thread's partial store
        # precede the (single-thread) ticket, whose acq_rel ordering publishes them to the last arriver.
        part_ptrs = ws_ptr + offs_m[None, :] * N + offs_n[:, None]
        tl.store(part_ptrs + split.to(tl.int64) * M * N, acc, mask=mask)
        tl.debug_barrier()
        tile = pid_m * n_tiles + pid_n
        ticket = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if ticket == n_splits - 1:
            # Fixed order, so the sum does not depend on arrival order; four partials are loaded per round
            # (independent loads, one L2 round trip) since this tail is on the kernel's critical path.
            total = tl.zeros((BN, BM), dtype=tl.float32)
            for s0 in range(0, n_splits, 4):
                left = tl.zeros((BN, BM), tl.int32) + (n_splits - s0)  # as a tensor: interpreter masks
                p0 = tl.load(part_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
                p1 = tl.load(part_ptrs + M * N, mask=mask & (left > 1), other=0.0, cache_modifier=".cg")
                p2 = tl.load(part_ptrs + 2 * M * N, mask=mask & (left > 2), other=0.0, cache_modifier=".cg")
                p3 = tl.load(part_ptrs + 3 * M * N, mask=mask & (left > 3), other=0.0, cache_modifier=".cg")
                total = (((total + p0) + p1) + p2) + p3
                part_ptrs += 4 * M * N
            tl.atomic_xchg(cnt_ptr + tile, 0)  # re-arm the ticket for the next launch
            _emit(total, out_ptrs, mask, pid_n, offs_n, M, N, lb0, lb1, lb2, ls0, ls1, ls2, lst1, lst2, lr, lstate,
                  arrived, BN, BM, BR, LORA)  # fmt: skip


_PLACEHOLDERS: dict[torch.device, tuple[Tensor, ...]] = {}


def placeholders(device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """Typed int32, fp32 and int64 stand-ins for the LoRA arguments of a launch without LoRA: Triton compiles
    (and type-checks) the never-taken rank branch anyway."""
    if device not in _PLACEHOLDERS:
        _PLACEHOLDERS[device] = tuple(torch.zeros(1, dtype=d, device=device)
                                      for d in (torch.int32, torch.float32, torch.int64))  # fmt: skip
    return _PLACEHOLDERS[device]


class Launch(NamedTuple):
    """A decode GEMV launch's LoRA side: rank programs at the grid's front, the kernels' trailing arguments (the
    LoRA ones, then the stamp buffer) and their LORA / BR / STAMPS constexprs."""

    rank_programs: int
    tail: tuple
    constexprs: dict


def launch_args(
    x: Tensor,
    n: int,
    lora: LoraDelta | None,
    block_m: int,
    block_n: int,
    counters,
    tile_programs: int,
    stamps: Tensor | None,
    slice_one_row: int = SLICE_ONE_ROW,
) -> Launch:
    """The Launch for x [M, K] @ W^T [N] over `tile_programs` weight programs. counters() returns the zeroed
    int32 counters the LoRA slice tickets need (called only with lora); stamps: timeline.SLOTS int64 per program;
    slice_one_row: K per rank program at M = 1 (gemv_lora.lora_args)."""
    i32, f32, i64 = placeholders(x.device)
    if lora is None:  # typed placeholders: Triton compiles the (never taken) rank branch even without LORA
        rank, tail, consts = 0, (0, *[x] * 6, *[0.0] * 3, 0, 0, 0, 0, f32, i64, i32), dict(LORA=False, BR=16)
    else:
        if not fits(lora, x, n, block_m, block_n):
            raise ValueError("decode GEMV: these LoRA adapters do not fit the fused path (gemv_lora.fits)")
        largs = lora_args(lora, x.shape[0], block_m, counters(), x.device, slice_one_row)
        rank, tail, consts = largs.programs, (largs.programs, *largs.args), dict(LORA=True, BR=largs.block_r)
    if stamps is not None:  # (written unchecked by the kernel)
        check_stamps(stamps, rank + tile_programs, x.device)
    return Launch(rank, (*tail, stamps if stamps is not None else i32), dict(consts, STAMPS=stamps is not None))
