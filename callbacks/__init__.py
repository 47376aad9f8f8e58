"""Lightning callbacks of orbit-lightning (installed as `orbit_lightning.callbacks`)."""

from .adapter_push import AdapterPush
from .checkpoint import RLStepCheckpoint
from .evaluation import EvalCallback
from .failsafe import FailSafe, RunInterrupted
from .memory import MemoryTracker

__all__ = ["AdapterPush", "EvalCallback", "FailSafe", "MemoryTracker", "RLStepCheckpoint", "RunInterrupted"]
