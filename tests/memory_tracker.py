"""Tensor accounting on CPU: the peak bytes of tensors freshly allocated (and still alive) inside a region.

A TorchDispatchMode sees every op output; each output that owns a fresh storage is counted until its Python
tensor dies (weakref). It is the CPU stand-in for `torch.cuda.max_memory_allocated`, precise enough to tell
"one chunk of experts" from "all experts" or "a weight-sized gradient".
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorTracker(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self.shapes: list[tuple[tuple[int, ...], int]] = []
        self._seen: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self._seen or key == 0:
                continue  # a view of a tensor already counted (or of one allocated outside the region)
            nbytes = storage.nbytes()
            self._seen.add(key)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            self.shapes.append((tuple(t.shape), nbytes))
            weakref.finalize(t, self._free, key, nbytes)
        return out
