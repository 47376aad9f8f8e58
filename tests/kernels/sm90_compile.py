"""Compiling kernels for sm_90 without a GPU, for the compile tests: Triton's compiler and its bundled ptxas run on any
machine, and a kernel the interpreter accepts may still fail there (or, for Gluon, cannot be interpreted at all)."""

import json
import os
import subprocess
import sys
import tempfile

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


def ptxas_usage(ptx: str) -> dict:
    """Run the bundled ptxas on PTX for sm_90a: {"registers": per thread, "spills": any spill store or load, "log":
    ptxas -v's report}. (Called inside the compile scripts.)"""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90)
    ptxas = getattr(ptxas, "path", ptxas)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        log = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"], capture_output=True,
                             text=True, check=True).stderr
    return {"registers": int(log.split("Used ")[1].split(" registers")[0]), "log": log,
            "spills": log.count("0 bytes spill stores") != 1 or log.count("0 bytes spill loads") != 1}


def compile_report(script: str) -> dict:
    """Run a compile script in a fresh interpreter without TRITON_INTERPRET (the compiler, not the interpreter, must
    see the kernels; the repository root on its path, for ptxas_usage) and return the JSON report it prints last."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])
