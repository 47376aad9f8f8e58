"""FailSafe: no trained progress is lost when a run stops early.

- SIGTERM (a scheduler's preemption) or a first Ctrl-C lets the RL step under way finish. Lightning's SIGTERM flag,
  which Ctrl-C raises here too, stops the loop after that step's metrics and periodic checkpoint are written; this
  callback then writes that step boundary as `last.ckpt`, the checkpoint `trainer.resume=auto` continues from
  exactly. A signal during the evaluation before the first step stops there, with nothing new to keep.
- A second Ctrl-C stops at once, mid-step: the last periodic checkpoint stays, since a half-done update is not one a
  resumed run could continue exactly.
- A step that raises (NaN gradients, a broken reward server, OOM...) writes `crash.ckpt` before the error
  propagates. It holds what the run had when it failed, possibly part of that step's update, so `resume=auto` does
  not take it: resume from it by path, knowing that.

Each stop by a signal is kept as a `RunInterrupted` (`interrupted`), which train.run_train raises and the CLI turns
into exit status 128 + the signal.
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
    """A run stopped by a signal. checkpoint: what a resume continues from (None: nothing was ever checkpointed);
    mid_step: the step under way was dropped (a second Ctrl-C)."""

    def __init__(self, signum: int, rl_step: int, checkpoint: Path | None, mid_step: bool = False):
        super().__init__(signum, rl_step, checkpoint, mid_step)
        self.signum, self.rl_step, self.checkpoint, self.mid_step = signum, rl_step, checkpoint, mid_step

    def __str__(self) -> str:
        name = signal.Signals(self.signum).name
        where = (f"the last checkpoint is {self.checkpoint}; resume with trainer.resume=auto (same "
                 "trainer.output_dir)") if self.checkpoint else "no checkpoint was written"
        if self.mid_step:
            return f"stopped by {name} during RL step {self.rl_step + 1}, which is not kept; {where}"
        return f"stopped by {name} after RL step {self.rl_step}; {where}"


class FailSafe(L.Callback):
    def __init__(self, dirpath: str | Path):
        self.dirpath = Path(dirpath)
        self.saved: Path | None = None
        self.interrupted: RunInterrupted | None = None
        self._signal: int | None = None
        self._previous: dict[int, object] = {}
        self._first_step = 0  # global_step when this fit started (a resumed run's checkpoint's)

    # ---- signals: stop at the next step boundary ----------------------------------------------------------

    def on_train_start(self, trainer: L.Trainer, pl_module) -> None:
        # (the first callback: these handlers cover the other callbacks' on_train_start, the first evaluation)
        self._first_step = trainer.global_step
        lightning_sigterm = signal.getsignal(signal.SIGTERM)  # sets trainer.received_sigterm (Lightning's connector)
        if threading.current_thread() is not threading.main_thread() or not callable(lightning_sigterm):
            return  # signal handlers live in the main thread; without Lightning's flag, keep the defaults

        def on_signal(signum: int, frame) -> None:
            if self._signal is not None and signum == signal.SIGINT:  # the second Ctrl-C: stop now
                self._restore()
                raise KeyboardInterrupt
            self._signal = signum
            log.warning("received %s: stopping once the RL step under way is done and checkpointed%s",
                        signal.Signals(signum).name, " (Ctrl-C again stops at once)" if signum == signal.SIGINT else "")
            lightning_sigterm(signal.SIGTERM, frame)

        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, on_signal)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module, batch, batch_idx: int) -> None:
        # A signal before this fit's first step (during the first evaluation): the state is the one it started from.
        if self._signal is not None and trainer.global_step == self._first_step:
            raise RunInterrupted(self._signal, pl_module.rl_step, self._last())

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def on_train_end(self, trainer: L.Trainer, pl_module) -> None:
        self._restore()

    def _last(self) -> Path | None:
        last = self.dirpath / "last.ckpt"
        return last if last.is_file() else None

    # ---- errors: checkpoint before the error propagates ---------------------------------------------------

    def on_exception(self, trainer: L.Trainer, pl_module, exception: BaseException) -> None:
        self._restore()
        if isinstance(exception, RunInterrupted):  # (on_train_batch_start's: nothing new to save)
            self.interrupted = exception
        elif isinstance(exception, KeyboardInterrupt):
            self.interrupted = RunInterrupted(signal.SIGINT, pl_module.rl_step, self._last(), mid_step=True)
        elif isinstance(exception, SIGTERMException):  # Lightning's stop after a whole step: a clean boundary
            path = self._save(trainer, "last.ckpt")
            self.interrupted = RunInterrupted(self._signal or signal.SIGTERM, pl_module.rl_step, path)
        elif trainer.global_step:
            path = self._save(trainer, "crash.ckpt")
            if path is not None:
                log.error("step failed with %s: %s; its state written to %s (resume from it by path: it may hold "
                          "part of the failed step's update)", type(exception).__name__, exception, path)

    def _save(self, trainer: L.Trainer, name: str) -> Path | None:
        path = self.dirpath / name
        try:
            trainer.save_checkpoint(path, weights_only=False)
        except Exception as e:  # never mask the original error
            log.error("could not write %s: %s", path, e)
            return None
        self.saved = path
        return path
