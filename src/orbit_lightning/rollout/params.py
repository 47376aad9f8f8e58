"""Sampling parameters of one request (vLLM's names), checked per request rather than at construction.

A bad value must fail only its own request (the engine answers it with `RequestOutput.error`) while the rest
of the batch runs, so `SamplingParams(...)` never raises; the engine calls `problem()` when it takes the request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class SamplingParams:
    n: int = 1  # samples per prompt; they share the prompt's prefill KV blocks
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 = off
    top_k: int | None = -1  # -1, 0 or None = off
    max_new_tokens: int | None = 16  # None = until the engine's max_model_len
    stop_token_ids: list[int] | None = None
    stop: str | list[str] | None = None  # stop strings; need the engine's tokenizer
    seed: int | None = None  # sample j draws from a generator seeded by (seed, j)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def top_k_or_off(self) -> int:
        """k >= 1, or 0 when top-k is off."""
        return 0 if self.top_k in (None, -1, 0) else int(self.top_k)

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def problem(self, has_tokenizer: bool) -> str | None:
        """What is wrong with these parameters, as a message for the request's error, or None if they are fine."""
        if not _is_int(self.n) or self.n < 1:
            return f"n must be an int >= 1, got {self.n!r}"
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            return f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}"
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            return f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}"
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < -1):
            return f"top_k must be an int >= 1, or -1/0/None for off, got {self.top_k!r}"
        if self.max_new_tokens is not None and (not _is_int(self.max_new_tokens) or self.max_new_tokens < 0):
            return f"max_new_tokens must be an int >= 0 (or None for up to max_model_len), got {self.max_new_tokens!r}"
        if self.stop_token_ids is not None and not all(_is_int(t) for t in self.stop_token_ids):
            return f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}"
        strings = self.stop_strings
        if not all(isinstance(s, str) and s for s in strings):
            return f"stop must be a non-empty string or a list of them, got {self.stop!r}"
        if strings and not has_tokenizer:
            return "stop strings need a tokenizer: pass RolloutEngine(model, tokenizer=...) or use stop_token_ids"
        if self.seed is not None and not _is_int(self.seed):
            return f"seed must be an int or None, got {self.seed!r}"
        return None


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
