"""orbit-lightning: RL post-training of BF16 adapters on a frozen low-precision base, in PyTorch Lightning."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

__version__ = "0.1.0"


def _demote_kernels_shadows() -> None:
    """Keep a source checkout from shadowing the `kernels` distribution that transformers imports.

    transformers >= 5.25 requires Hugging Face's `kernels` package and imports it by that top-level name while
    loading any model. A checkout holds two modules of that name: `kernels/` at its root (installed as
    `orbit_lightning.kernels`) and `bench/kernels.py`. Running from the root (`python -m ...`, pytest's
    `pythonpath`) or running a bench script puts their directory on sys.path ahead of site-packages, and transformers
    then fails with "cannot import name ... from 'kernels'". Moving those entries to the end of sys.path keeps the
    rest of them importable (`tests.*`, the bench helpers) and lets `import kernels` find the installed package.
    Entries are recognized by what they hold, not by where this package was imported from, so a wheel run from a
    checkout is covered too.
    """

    def shadows(entry: str) -> bool:
        path = Path(entry or ".").resolve()  # ("" is the working directory)
        root = path.parent if path.name == "bench" else path
        checkout = (root / "src" / "orbit_lightning").is_dir() and (root / "pyproject.toml").is_file()
        return checkout and ((path / "kernels" / "__init__.py").is_file() or (path / "kernels.py").is_file())

    shadowing = [entry for entry in sys.path if shadows(entry)]
    if shadowing:
        sys.path[:] = [entry for entry in sys.path if entry not in shadowing] + shadowing


_demote_kernels_shadows()

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
