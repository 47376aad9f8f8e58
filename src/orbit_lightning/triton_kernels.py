"""Optional access to the Triton kernels (`orbit_lightning.kernels`): None / False where Triton cannot be imported
(e.g. macOS), so every caller falls back to its pure-torch path the same way."""

from __future__ import annotations

import functools

import torch


def kernels_module():
    """The `orbit_lightning.kernels` module, or None without Triton."""
    try:
        from orbit_lightning import kernels
    except ImportError:
        return None
    return kernels


def kernels_run_on(device: torch.device) -> bool:
    """Whether the kernels can run on `device` (CUDA with bf16 tensor cores, or the CPU under the interpreter).
    Asked per op on hot paths (every RMSNorm, LoRA and attention call), so the answer is cached per device: it
    depends only on the device's capability and on whether the interpreter was on at import."""
    return _run_on(torch.device(device))


@functools.cache
def _run_on(device: torch.device) -> bool:
    k = kernels_module()
    return k is not None and k.kernels_available(device)
