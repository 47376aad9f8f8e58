"""Root conftest: loaded before any test module is imported.

Triton's interpreter must be on before `triton` is first imported anywhere (peft, torchao and transformers
import it too): triton.language's own @jit helpers (e.g. tl.cdiv) are built at import time, and the CPU
kernel tests need them interpreted. Without CUDA there is nothing else Triton could run on, so switching the
interpreter on for the whole CPU test session changes nothing else.
"""

import os

import torch

# Before any test module imports transformers: moves the checkout root (its `kernels/`) behind the HF `kernels`
# package that transformers imports (see orbit_lightning/__init__.py).
import orbit_lightning  # noqa: F401

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
