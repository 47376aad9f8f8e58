"""Zeroed int32 tickets for deterministic split reductions (the split-K GEMMs, the GEMV, the LoRA down-projection).

A split program stores its fp32 partial, then takes a ticket on its output tile (an acq_rel atomic); the last
arriver sums the partials in split order, so results do not depend on arrival order, and re-zeroes the ticket
for the next launch. One buffer per (device, stream): kernels on one stream run in order, so they can share it.
"""

from __future__ import annotations

import torch
from torch import Tensor

_TICKETS: dict[tuple[torch.device, int], Tensor] = {}


def tickets(device: torch.device, n: int) -> Tensor:
    """At least `n` zeroed int32 tickets for a launch on the current stream of `device`."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    buf = _TICKETS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _TICKETS[key] = buf
    return buf
