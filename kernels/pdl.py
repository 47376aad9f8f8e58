"""Programmatic dependent launch (PDL) for the decode-path kernels.

A CUDA-graph-replayed decode step is ~190 small launches, and between two of them the GPU idles while the next
grid is launched (a batch-1 Qwen3-8B step: 1.15 ms of kernels in 1.34 ms, bench/RESULTS.md). On sm_90+ a kernel
launched with `launch_pdl=True` may be scheduled while the kernel before it in the stream is still finishing.
It then blocks in `wait_for_producers` (griddepcontrol.wait) until that kernel has completed and its writes are
visible. Every kernel launched this way calls the wait before touching memory that an earlier kernel may write or
still read; the one exception is the split GEMV, whose first packed-weight loads come first (frozen weights, which
no kernel writes). Without PDL the wait is a no-op, so results are the same bits either way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

try:  # griddepcontrol intrinsics (triton >= 3.5)
    from triton.language.extra.cuda import gdc_wait

    _HAVE = True
except ImportError:  # pragma: no cover - older triton: never enabled
    _HAVE = False

    @triton.jit
    def gdc_wait():
        pass


ENABLED = True  # process-wide switch (benchmarks A/B it); the launch still needs an sm_90+ GPU and compiled kernels
_CAPABLE: dict[int, bool] = {}


@triton.jit
def wait_for_producers(PDL: tl.constexpr):
    """Block until the kernel before this one in the stream has completed (only when launched with PDL)."""
    if PDL:
        gdc_wait()


def use_pdl(device: torch.device) -> bool:
    """Whether kernels launched on `device` take PDL: enabled, compiled (not Triton's interpreter) and sm_90+."""
    if not ENABLED or device.type != "cuda":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _CAPABLE:
        from .gemm import INTERPRETED  # (here, not at import: gemm imports the kernels that import this module)

        _CAPABLE[idx] = _HAVE and not INTERPRETED and torch.cuda.get_device_capability(idx) >= (9, 0)
    return _CAPABLE[idx]
