"""orbit-lightning: RL post-training of BF16 adapters on a frozen low-precision base, in PyTorch Lightning."""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# Public names resolve lazily so that `import orbit_lightning` stays cheap (no Lightning/torchao import).
_PUBLIC = {
    "load_model": "orbit_lightning.models.loader",
    "add_adapter": "orbit_lightning.adapters",
    "save_adapter": "orbit_lightning.adapters",
    "load_adapter": "orbit_lightning.adapters",
    "export_hf_state_dict": "orbit_lightning.adapters",
    "RLModule": "orbit_lightning.module",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'orbit_lightning' has no attribute {name!r}")
