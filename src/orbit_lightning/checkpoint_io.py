"""Atomic checkpoint writes: write a temp file in the same directory, fsync, then rename over the target.

A crash mid-write leaves the previous checkpoint intact (Lightning's default writes the target in place).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def load_checkpoint(self, path, map_location: Any | None = None, weights_only: bool | None = None,
                        mmap: bool = False):
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint {path} does not exist; pass trainer.resume=<path to a .ckpt> or "
                                    "trainer.resume=auto (<output_dir>/checkpoints/last.ckpt)")
        try:
            checkpoint = torch.load(path, map_location=map_location or "cpu", weights_only=False, mmap=mmap)
        except Exception as e:  # a truncated or foreign file
            raise ValueError(f"cannot read checkpoint {path}: {e} (corrupt or not a checkpoint?)") from e
        if not isinstance(checkpoint, dict) or "global_step" not in checkpoint:  # e.g. an adapter's safetensors
            raise ValueError(f"{path} is not a training checkpoint (no global_step); pass a .ckpt from "
                             "<output_dir>/checkpoints, or trainer.resume=auto")
        return checkpoint


def checkpoint_steps(path) -> tuple[int, int]:
    """(optimizer steps, RL steps) a training checkpoint holds (the RL count is the module's: optimizer steps per RL
    step may differ between runs); a missing, corrupt or foreign file is a clear error. Memory-mapped: only what is
    read is loaded."""
    checkpoint = AtomicCheckpointIO().load_checkpoint(path, mmap=True)
    return int(checkpoint["global_step"]), int(checkpoint.get("orbit", {}).get("rl_step", 0))
