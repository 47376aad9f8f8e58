"""RLStepCheckpoint: every N RL steps, the run's state as `rl_step=<k>.ckpt` (the previous one removed) and
`last.ckpt`, the file `trainer.resume=auto` continues from.

Lightning's ModelCheckpoint counts optimizer steps (`global_step`), of which an RL step makes updates_per_step x
minibatches: after a resume from a checkpoint written part-way through an RL step's updates (a crash.ckpt), its
`global_step % N` never again fell on an RL-step boundary and no periodic checkpoint was written for the rest of
the run. This one counts the module's RL steps.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import lightning as L


class RLStepCheckpoint(L.Callback):
    def __init__(self, dirpath: str | Path, every_n_rl_steps: int):
        if every_n_rl_steps < 1:
            raise ValueError(f"every_n_rl_steps must be >= 1, got {every_n_rl_steps}")
        self.dirpath, self.every_n = Path(dirpath), every_n_rl_steps
        self.latest: Path | None = None  # this run's last periodic file

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        # (after the step's updates, where Lightning's ModelCheckpoint saves: a resume continues with the next step)
        if pl_module.rl_step % self.every_n == 0:
            self.save(trainer, pl_module.rl_step)

    def save(self, trainer: L.Trainer, rl_step: int) -> Path:
        path = self.dirpath / f"rl_step={rl_step}.ckpt"
        previous, self.latest = self.latest, path  # (first: the checkpoint's own state names it, for a resume)
        trainer.save_checkpoint(path, weights_only=False)  # (atomic: checkpoint_io.AtomicCheckpointIO)
        self._link_last(path)
        if previous is not None and previous != path and previous.is_file():
            previous.unlink()
        return path

    def state_dict(self) -> dict:  # a resumed run removes the file it continued from once it writes the next one
        return {"latest": str(self.latest) if self.latest else None}

    def load_state_dict(self, state_dict: dict) -> None:
        self.latest = Path(state_dict["latest"]) if state_dict.get("latest") else None

    def _link_last(self, path: Path) -> None:
        """last.ckpt as a second name of `path` (no second write of the state), a copy where links are refused."""
        last, tmp = self.dirpath / "last.ckpt", self.dirpath / "last.ckpt.tmp"
        tmp.unlink(missing_ok=True)
        try:
            os.link(path, tmp)
        except OSError:
            shutil.copyfile(path, tmp)
        os.replace(tmp, last)
