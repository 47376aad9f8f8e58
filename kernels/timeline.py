"""Per-program timestamps inside a kernel, to see where a short kernel's microseconds go (a development tool).

A decode GEMV of a few MB takes 7-10 us whether its weights sit in HBM or in L2 (bench/RESULTS.md), so its time is
latency: the launch, the waves of programs, the PDL wait, the dependent loads of the main loop, the split-K tail.
A kernel built with stamps on records, per program, the SM it ran on, the global nanosecond timer at entry and
exit, and the SM's cycle counter at a few points (`stamp`); `bench/gemv_timeline.py` turns that into a timeline.
Stamps are a constexpr switch: off, the kernel compiles as if they were not there. They need the GPU (inline PTX),
not Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

SLOTS = 8  # int64 per program: see the slot constants below
# Slots: 0 entry (global ns), 1 exit (global ns), 2 SM id, 3.. cycle counters at the points a kernel marks.
ENTRY_NS, EXIT_NS, SM_ID, CYCLES = 0, 1, 2, 3
_SLOTS = tl.constexpr(SLOTS)
# The special registers read, shared by the Triton and the Gluon stamps (one dialect cannot call the other's jit
# functions, so each has its own few lines around them).
_GLOBALTIMER = tl.constexpr("mov.u64 $0, %globaltimer;")
_CLOCK = tl.constexpr("mov.u64 $0, %clock64;")
_SMID = tl.constexpr("mov.u32 $0, %smid;")


def check_stamps(stamps: torch.Tensor, programs: int, device: torch.device) -> None:
    """A kernel writes SLOTS int64 per program into `stamps` unchecked: refuse a buffer it would overrun."""
    if (stamps.dtype != torch.int64 or not stamps.is_contiguous() or stamps.device != device
            or stamps.numel() < programs * SLOTS):
        raise ValueError(f"stamps: need a contiguous int64 tensor of at least [{programs}, {SLOTS}] on {device} "
                         f"(one row per program), got {stamps.dtype} {tuple(stamps.shape)} on {stamps.device}")


@triton.jit
def _globaltimer():
    return tl.inline_asm_elementwise(_GLOBALTIMER, "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _clock():
    return tl.inline_asm_elementwise(_CLOCK, "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _smid():
    return tl.inline_asm_elementwise(_SMID, "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def stamp(ptr, program, slot: tl.constexpr, ON: tl.constexpr):
    """Record slot `slot` of program `program`: the global timer for ENTRY_NS (also the SM id and a cycle count
    into CYCLES) and EXIT_NS, the cycle counter for slots > CYCLES."""
    if ON:
        row = ptr + program.to(tl.int64) * _SLOTS
        if slot == 0:
            tl.store(row + 2, _smid().to(tl.int64))
            tl.store(row + 3, _clock())
            tl.store(row, _globaltimer())
        elif slot == 1:
            tl.store(row + 1, _globaltimer())
        else:
            tl.store(row + slot, _clock())


@triton.jit
def linear_program():
    """This program's index in a row-major walk of the grid (axis 0 fastest), as the stamp buffer's rows."""
    return tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1) * tl.program_id(2))


@gluon.jit
def _gl_globaltimer():
    return gl.inline_asm_elementwise(_GLOBALTIMER, "=l", [], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def _gl_clock():
    return gl.inline_asm_elementwise(_CLOCK, "=l", [], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def _gl_smid():
    return gl.inline_asm_elementwise(_SMID, "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def gluon_stamp(ptr, program, slot: gl.constexpr, ON: gl.constexpr):
    """`stamp` for Gluon kernels (wgmma_int4.py): the same slots and registers."""
    if ON:
        row = ptr + program.to(gl.int64) * _SLOTS
        if slot == 0:
            gl.store(row + 2, _gl_smid().to(gl.int64))
            gl.store(row + 3, _gl_clock())
            gl.store(row, _gl_globaltimer())
        elif slot == 1:
            gl.store(row + 1, _gl_globaltimer())
        else:
            gl.store(row + slot, _gl_clock())
