"""Start pulling frozen weights into L2 ahead of the kernel that reads them.

A batch-1 decode step alternates GEMVs, which stream packed weights at HBM speed, with chains of small kernels
(norms, RoPE, attention, LoRA) that leave HBM nearly idle for tens of microseconds. `prefetch_l2` issues
`cp.async.bulk.prefetch.L2` for the next weights at the start of such a chain. It is one tiny launch that
issues its prefetches before it waits for the kernel before it (the weights are frozen), so under PDL they overlap
that kernel's tail. The
prefetch is a hint with no completion and no effect on values: the reading kernel is unchanged, and finds its
bytes in L2 instead of HBM. Only sm_90+ GPUs have the instruction; elsewhere (and in Triton's interpreter)
this is a no-op.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from .pdl import use_pdl, wait_for_producers

CHUNK = 64 << 10  # bytes per prefetch instruction
_BLOCK = 128  # instructions per program (one per thread of 4 warps)
MAX_SEGMENTS = 4


@triton.jit
def _issue(ptr, n_bytes, offs, CHUNK: tl.constexpr):
    """Each lane prefetches bytes [offs, offs + CHUNK) of the segment (clipped to n_bytes, a 16-byte multiple)."""
    size = tl.maximum(tl.minimum(n_bytes - offs, CHUNK), 0).to(tl.int32)
    base = ptr.to(tl.pointer_type(tl.uint8)) + offs
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [base, size], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _prefetch_kernel(p0, n0, p1, n1, p2, n2, p3, n3, NSEG: tl.constexpr, CHUNK: tl.constexpr,
                     BLOCK: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    offs = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64) * CHUNK
    _issue(p0, n0, offs, CHUNK)
    if NSEG > 1:
        _issue(p1, n1, offs, CHUNK)
    if NSEG > 2:
        _issue(p2, n2, offs, CHUNK)
    if NSEG > 3:
        _issue(p3, n3, offs, CHUNK)
    # Read nothing that a kernel writes, but complete only after the kernel before: a later kernel's PDL wait
    # covers only the kernel just before it, so this keeps the stream's order transitive.
    wait_for_producers(PDL)


_CAPABLE: dict[int, bool] = {}


def prefetch_available(device: torch.device) -> bool:
    """Whether `prefetch_l2` does anything on `device`: a compiled (not interpreted) sm_90+ GPU."""
    if device.type != "cuda":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _CAPABLE:
        from .gemm import INTERPRETED

        _CAPABLE[idx] = not INTERPRETED and torch.cuda.get_device_capability(idx) >= (9, 0)
    return _CAPABLE[idx]


def prefetch_l2(tensors: Sequence[Tensor], max_bytes: int | None = None) -> int:
    """Hint L2 to load `tensors` (in order, at most `max_bytes` in all) and return the bytes requested. Each
    tensor's storage span from its first element is taken, 16-byte aligned: a contiguous view prefetches
    exactly its bytes. Up to MAX_SEGMENTS tensors per launch; more take further launches."""
    segs: list[tuple[Tensor, int]] = []
    budget = max_bytes if max_bytes is not None else 1 << 62
    for t in tensors:
        if budget <= 0:
            break
        if not t.is_contiguous() or t.data_ptr() % 16:
            continue  # a strided view's bytes are not one span; misaligned starts are not allowed
        n = min(t.numel() * t.element_size(), budget) // 16 * 16
        if n:
            segs.append((t, n))
            budget -= n
    if not segs or not prefetch_available(segs[0][0].device):
        return 0
    pdl = use_pdl(segs[0][0].device)
    for i in range(0, len(segs), MAX_SEGMENTS):
        part = segs[i : i + MAX_SEGMENTS]
        args = [a for t, n in part for a in (t, n)]
        args += [part[0][0], 0] * (MAX_SEGMENTS - len(part))
        grid = (triton.cdiv(max(n for _, n in part), CHUNK * _BLOCK),)
        _prefetch_kernel[grid](*args, NSEG=len(part), CHUNK=CHUNK, BLOCK=_BLOCK, PDL=pdl,
                               num_warps=4, launch_pdl=pdl)  # fmt: skip
    return sum(n for _, n in segs)
