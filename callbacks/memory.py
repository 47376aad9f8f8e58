"""MemoryTracker: per-phase peak memory and time (rollout, reference, old_logprobs, train, push) each RL step.

The module measures phases with `orbit_lightning.rl.phases.PhaseTimer` (CUDA allocator peaks on GPU, sampled
RSS on CPU); this callback logs them as `memory/<phase>_peak_bytes`, `memory/<phase>_reserved_bytes` and
`time/<phase>`, and keeps the history for the end-of-run report.
"""

from __future__ import annotations

import lightning as L


class MemoryTracker(L.Callback):
    def __init__(self):
        self.history: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        metrics = pl_module.phases.metrics()
        for k, v in metrics.items():
            pl_module.log(k, v, on_step=True, batch_size=1)
        self.history.append({"rl_step": float(pl_module.rl_step), **metrics})
