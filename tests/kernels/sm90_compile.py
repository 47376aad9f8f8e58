"""Compiling kernels for sm_90 without a GPU, for the compile tests: Triton's compiler and its bundled ptxas run on any
machine, and a kernel the interpreter accepts may still fail there (or, for Gluon, cannot be interpreted at all)."""

import json
import os
import subprocess
import sys

import pytest


def _sm90_compiler_available() -> bool:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        get_ptxas(90)
        return True
    except Exception:
        return False


# Compile tests need Triton's NVIDIA backend and its bundled ptxas, not a GPU.
needs_sm90_compiler = pytest.mark.skipif(not _sm90_compiler_available(),
                                         reason="this triton install has no NVIDIA backend / ptxas")


def compile_report(script: str) -> dict:
    """Run a compile script in a fresh interpreter without TRITON_INTERPRET (the compiler, not the interpreter, must
    see the kernels) and return the JSON report it prints last."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])
