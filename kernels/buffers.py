"""Device buffers that outlive a launch: one per (kind, device, stream), zeroed when made.

The decode kernels keep small counters between launches (split-K tickets, the fused LoRA's epoch and its tagged
t words). Two streams must not share them, since launches on one stream are ordered and across streams are not.
A buffer only grows; callers that need a fixed address across launches ask for their full size every time.
"""

from __future__ import annotations

import torch
from torch import Tensor

_BUFFERS: dict[tuple[str, torch.device, int], Tensor] = {}


def stream_buffer(kind: str, device: torch.device, n: int, dtype: torch.dtype) -> Tensor:
    """The zero-initialized `kind` buffer of at least n elements for the current stream of `device`."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (kind, device, stream)
    buf = _BUFFERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(n, dtype=dtype, device=device)
        _BUFFERS[key] = buf
    return buf
