"""FailSafe: no trained progress is lost when a run stops early.

- A step that raises (NaN gradients, a broken reward server, OOM...) writes `crash.ckpt` before the error propagates.
- SIGTERM (a scheduler's preemption) or a first Ctrl-C lets the RL step under way finish. Lightning's SIGTERM flag,
  which Ctrl-C raises here too, stops the loop after that step's metrics and periodic checkpoint are written; this
  callback then writes `crash.ckpt` at that step boundary and keeps a `RunInterrupted` (`interrupted`), which
  train.run_train raises and the CLI turns into exit status 128 + the signal.
- A second Ctrl-C stops at once, mid-step, keeping the last periodic checkpoint: a half-done update is not one a
  resumed run could continue exactly.

Resume with `trainer.resume=auto` (the newer of last.ckpt and crash.ckpt) or `trainer.resume=<path>`.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

import lightning as L
from lightning.pytorch.utilities.exceptions import SIGTERMException

log = logging.getLogger(__name__)


class RunInterrupted(Exception):
    """A run stopped at an RL step boundary by a signal (raised by train.run_train once Lightning has stopped)."""

    def __init__(self, signum: int, rl_step: int, checkpoint: Path | None):  # checkpoint None: it could not be written
        super().__init__(signum, rl_step, checkpoint)
        self.signum, self.rl_step, self.checkpoint = signum, rl_step, checkpoint

    def __str__(self) -> str:
        where = f"checkpoint {self.checkpoint}" if self.checkpoint else "no checkpoint could be written"
        return (f"stopped by {signal.Signals(self.signum).name} after RL step {self.rl_step}; {where}; resume with "
                "trainer.resume=auto (same trainer.output_dir)")


class FailSafe(L.Callback):
    def __init__(self, dirpath: str | Path):
        self.dirpath = Path(dirpath)
        self.saved: Path | None = None
        self.interrupted: RunInterrupted | None = None
        self._signal: int | None = None
        self._previous: dict[int, object] = {}

    # ---- signals: stop at the next step boundary ----------------------------------------------------------

    def on_train_start(self, trainer: L.Trainer, pl_module) -> None:
        if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
            return
        lightning_sigterm = signal.getsignal(signal.SIGTERM)  # sets trainer.received_sigterm (Lightning's connector)

        def on_signal(signum: int, frame) -> None:
            if self._signal is not None and signum == signal.SIGINT:  # the second Ctrl-C: stop now
                self._restore()
                raise KeyboardInterrupt
            self._signal = signum
            log.warning("received %s: stopping once the RL step under way is done and checkpointed%s",
                        signal.Signals(signum).name, " (Ctrl-C again stops at once)" if signum == signal.SIGINT else "")
            lightning_sigterm(signal.SIGTERM, frame)

        if not callable(lightning_sigterm):  # no Lightning handler to raise its flag: leave the defaults
            return
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, on_signal)

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def on_train_end(self, trainer: L.Trainer, pl_module) -> None:
        self._restore()

    # ---- errors: checkpoint before the error propagates ---------------------------------------------------

    def on_exception(self, trainer: L.Trainer, pl_module, exception: BaseException) -> None:
        self._restore()
        if isinstance(exception, KeyboardInterrupt):
            last = self.dirpath / "last.ckpt"
            log.error("interrupted mid-step, nothing checkpointed now; %s", f"the last checkpoint is {last}"
                      if last.is_file() else "no checkpoint was written before")
            return
        path = self._save(trainer) if trainer.global_step else None
        if isinstance(exception, SIGTERMException):
            self.interrupted = RunInterrupted(self._signal or signal.SIGTERM, pl_module.rl_step, path)
        elif path is not None:
            log.error("step failed with %s: %s; checkpoint written to %s", type(exception).__name__, exception, path)

    def _save(self, trainer: L.Trainer) -> Path | None:
        path = self.dirpath / "crash.ckpt"
        try:
            trainer.save_checkpoint(path)
        except Exception as e:  # never mask the original error
            log.error("could not write a crash checkpoint: %s", e)
            return None
        self.saved = path
        return path
