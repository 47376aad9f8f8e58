"""Batch-invariant (deterministic) mode: one global switch read by every kernel launcher.

In this mode every launch uses one fixed tile configuration per kernel and never splits the
reduction, so the fp32 accumulation order of an output row depends only on K (or N) and never on M,
on the row's position in the batch or on how tokens were grouped. The trainer (large M) and the
rollout engine (M = 1..64) then produce bit-identical rows for the same input.

Covered here:
- the dense and grouped GEMMs, packed or plain. They share one tile config, so a token's row is reduced
  alike on the dense and the MoE path;
- `rms_norm`, `add_rms_norm` and `logsumexp`: one row per program in every mode (the add is torch's);
- `attention` / `paged_attention`: one tile config, with key blocks counted from each sequence's first real
  token. paged_attention's flash-decoding split reduces keys in another order, so it is only chosen outside
  this mode.

`orbit_lightning.models.invariant.invariant_mode` routes a model's forward through them. The fused decode
projections (`quant.fusion.project`) stand aside in this mode, so the engine makes the trainer's per-layer
calls.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_state = threading.local()
_global = {"enabled": False}


def set_batch_invariant(enabled: bool) -> None:
    """Turn batch-invariant mode on or off for the whole process."""
    if not isinstance(enabled, bool):
        raise TypeError(f"set_batch_invariant expects a bool, got {type(enabled).__name__}")
    _global["enabled"] = enabled


def is_batch_invariant() -> bool:
    """True when kernels must use fixed tiles and no split-K (a `batch_invariant()` block wins)."""
    override = getattr(_state, "override", None)
    return _global["enabled"] if override is None else override


@contextlib.contextmanager
def batch_invariant(enabled: bool = True) -> Iterator[None]:
    """Context manager that enables (or disables) batch-invariant mode in this thread only."""
    previous = getattr(_state, "override", None)
    _state.override = enabled
    try:
        yield
    finally:
        _state.override = previous
