"""FailSafe: when a step raises (NaN gradients, a broken reward server, OOM...), write `crash.ckpt` before the
error propagates, so no trained progress is lost. Resume from it with `trainer.resume=<path>`."""

from __future__ import annotations

import logging
from pathlib import Path

import lightning as L

log = logging.getLogger(__name__)


class FailSafe(L.Callback):
    def __init__(self, dirpath: str | Path):
        self.dirpath = Path(dirpath)
        self.saved: Path | None = None

    def on_exception(self, trainer: L.Trainer, pl_module, exception: BaseException) -> None:
        if isinstance(exception, KeyboardInterrupt) or trainer.global_step == 0:
            return
        path = self.dirpath / "crash.ckpt"
        try:
            trainer.save_checkpoint(path)
            self.saved = path
            log.error("step failed with %s: %s; checkpoint written to %s", type(exception).__name__, exception, path)
        except Exception as e:  # never mask the original error
            log.error("could not write a crash checkpoint: %s", e)
