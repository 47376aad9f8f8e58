"""Atomic checkpoint writes (atomic_write: a temp file in the same directory, fsync, then a rename over the target).

A crash mid-write leaves the previous checkpoint intact (Lightning's default writes the target in place).
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any, NamedTuple

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from .atomic_write import atomic_write


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        atomic_write(path, lambda tmp: torch.save(checkpoint, tmp))

    def load_checkpoint(self, path, map_location: Any | None = None, weights_only: bool | None = None,
                        mmap: bool = False):
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint {path} does not exist; pass trainer.resume=<path to a .ckpt> or "
                                    "trainer.resume=auto (<output_dir>/checkpoints/last.ckpt)")
        unreadable = (f"checkpoint {path} cannot be read: it is truncated, corrupt or not a torch checkpoint "
                      "({}). Resume from another .ckpt, or set trainer.resume=null to start afresh")
        if not zipfile.is_zipfile(path):  # (torch.save writes a zip; a truncated one has lost its directory)
            raise ValueError(unreadable.format("not a whole zip archive, which torch.save writes"))
        try:
            checkpoint = torch.load(path, map_location=map_location or "cpu", weights_only=False, mmap=mmap)
        except Exception as e:  # damage inside the archive; torch's own text runs to a paragraph: its first sentence
            raise ValueError(unreadable.format(f"torch: {str(e).split('. ')[0].rstrip('.')}")) from e
        if not isinstance(checkpoint, dict) or "global_step" not in checkpoint:  # e.g. an adapter's safetensors
            raise ValueError(f"{path} is not a training checkpoint (no global_step); pass a .ckpt from "
                             "<output_dir>/checkpoints, or trainer.resume=auto")
        return checkpoint


class CheckpointSteps(NamedTuple):
    global_step: int  # optimizer steps (Lightning's count)
    rl_step: int  # RL steps completed (the module's count)
    per_rl_step: int  # optimizer steps per RL step of the run that wrote it (0: not recorded, older checkpoints)


def checkpoint_steps(path) -> CheckpointSteps:
    """The step counts a training checkpoint holds (optimizer steps per RL step may differ between runs); a missing,
    corrupt or foreign file is a clear error. Memory-mapped: only what is read is loaded."""
    checkpoint = AtomicCheckpointIO().load_checkpoint(path, mmap=True)
    orbit = checkpoint.get("orbit", {})
    return CheckpointSteps(int(checkpoint["global_step"]), int(orbit.get("rl_step", 0)),
                           int(orbit.get("optimizer_steps_per_rl_step", 0)))
