"""Kernel tests run on the CPU through Triton's interpreter, which must be switched on before the kernels
are decorated (i.e. before `orbit_lightning.kernels` is first imported): this conftest sets
TRITON_INTERPRET=1 when there is no CUDA. Run the GPU tests on a CUDA machine with `-m gpu`; there
the variable stays unset so the same tests compile real kernels.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from orbit_lightning import kernels  # noqa: E402  (must follow the environment switch)


@pytest.fixture
def cpu_kernels():
    """Skip (with the reason) when the interpreter could not be enabled for this process."""
    if not kernels.kernels_available("cpu"):
        pytest.skip("orbit_lightning.kernels was imported before TRITON_INTERPRET=1 was set")

