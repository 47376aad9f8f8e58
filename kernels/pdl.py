"""Programmatic dependent launch (PDL) for the decode-path kernels.

A CUDA-graph-replayed decode step is ~190 small launches, and between two of them the GPU idles while the next
grid is launched (a batch-1 Qwen3-8B step: 1.15 ms of kernels in 1.34 ms, bench/RESULTS.md). On sm_90+ a kernel
launched with `launch_pdl=True` may be scheduled while the kernel before it in the stream is still finishing.
It then blocks in `wait_for_producers` (griddepcontrol.wait) until that kernel has completed and its writes are
visible. Every kernel launched this way calls the wait before touching memory that an earlier kernel may write or
still read; the exceptions are the decode GEMVs and the warpgroup-MMA kernel's dense tiles (wgmma_int4, in Gluon:
gluon_wait), whose first packed-weight loads come first (frozen weights, which no kernel writes). Without PDL the
wait is a no-op, so results are the same bits either way.

Right after its wait a kernel also *triggers* its dependents (griddepcontrol.launch_dependents): the next kernel
may then be scheduled as soon as SM room frees, not only once this one exits, so its launch and its weight loads
overlap this kernel's run. The decode GEMVs trigger after their weight loop instead: triggering before it cost
them registers (ptxas keeps more of the loop's addresses live across it). This is safe for any kernel: the
dependent still waits for this one to complete, and a grid triggers only once all of its programs have started,
so waiting programs never take the room of programs of the grid they wait on. Set ORBIT_PDL_TRIGGER=0 (read at
import) to measure without it.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .configs import capability
from .emulate import INTERPRETED

try:  # griddepcontrol intrinsics (triton >= 3.5)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _HAVE = True
except ImportError:  # pragma: no cover - older triton: never enabled
    _HAVE = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


ENABLED = True  # process-wide switch (benchmarks A/B it); the launch still needs an sm_90+ GPU and compiled kernels
TRIGGER = os.environ.get("ORBIT_PDL_TRIGGER", "1") != "0"
_TRIGGER = tl.constexpr(TRIGGER)
_CAPABLE: dict[int, bool] = {}


@triton.jit
def wait_for_producers(PDL: tl.constexpr, TRIGGER: tl.constexpr = True):
    """Block until the kernel before this one in the stream has completed, then (TRIGGER) let the next one launch
    (only when launched with PDL)."""
    if PDL:
        gdc_wait()
        if TRIGGER:
            launch_dependents(PDL)


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    """Let the next kernel in the stream launch now (only when launched with PDL; ORBIT_PDL_TRIGGER=0: never)."""
    if PDL and _TRIGGER:
        gdc_launch_dependents()


@gluon.jit
def gluon_wait():
    """wait_for_producers' griddepcontrol.wait in a Gluon kernel (Gluon has no op of its own; one call per
    thread that must wait). No-op without PDL."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def gluon_launch_dependents():
    """launch_dependents in a Gluon kernel (ORBIT_PDL_TRIGGER=0: never)."""
    if _TRIGGER:
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)


def use_pdl(device: torch.device) -> bool:
    """Whether kernels launched on `device` take PDL: enabled, compiled (not Triton's interpreter) and sm_90+."""
    if not ENABLED or device.type != "cuda":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _CAPABLE:
        _CAPABLE[idx] = _HAVE and not INTERPRETED and capability(device) >= (9, 0)
    return _CAPABLE[idx]
