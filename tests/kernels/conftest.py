"""Kernel tests run on the CPU through Triton's interpreter, which must be switched on before the kernels
are decorated (i.e. before `orbit_lightning.kernels` is first imported): this conftest, like the root one (which
also holds their `cpu_kernels` fixture), sets TRITON_INTERPRET=1 when there is no CUDA. Run the GPU tests on a CUDA
machine with `-m gpu`; there the variable stays unset so the same tests compile real kernels.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
