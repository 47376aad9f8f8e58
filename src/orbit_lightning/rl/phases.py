"""Per-phase wall time and peak memory (CUDA allocator when on GPU, process RSS on CPU).

The module wraps each phase of a step (rollout, reference, old_logprobs, train, push) in `PhaseTimer.phase`;
callbacks read `PhaseTimer.last` to log `time/<phase>` and `memory/<phase>_peak_bytes`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

import psutil
import torch


@dataclass
class PhaseStats:
    seconds: float
    peak_allocated: int  # bytes: CUDA max_memory_allocated, or peak RSS on CPU
    peak_reserved: int  # bytes: CUDA max_memory_reserved, or peak RSS on CPU


class _RssSampler:
    """CPU has no allocator high-water mark we can reset, so sample RSS in a thread during the phase."""

    def __init__(self, interval: float = 0.005):
        self.proc, self.interval, self.peak = psutil.Process(), interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            self._stop.wait(self.interval)

    def __enter__(self):
        self.peak = self.proc.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)


class PhaseTimer:
    def __init__(self, device: torch.device | None = None):
        self.device = device
        self.last: dict[str, PhaseStats] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        cuda = self.device is not None and self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        sampler = contextlib.nullcontext() if cuda else _RssSampler()
        with sampler as s:
            yield
            if cuda:
                torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        if cuda:
            alloc, reserved = torch.cuda.max_memory_allocated(self.device), torch.cuda.max_memory_reserved(self.device)
        else:
            alloc = reserved = s.peak
        self.last[name] = PhaseStats(seconds, alloc, reserved)

    def metrics(self) -> dict[str, float]:
        out = {}
        for name, st in self.last.items():
            out[f"time/{name}"] = st.seconds
            out[f"memory/{name}_peak_bytes"] = float(st.peak_allocated)
            out[f"memory/{name}_reserved_bytes"] = float(st.peak_reserved)
        return out
