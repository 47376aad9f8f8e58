"""SwiGLU's `silu(gate) * up` in one launch, bitwise equal to torch's `F.silu(gate) * up` on CUDA.

torch's CUDA silu computes `x / (1 + expf(-x))` in fp32 (its opmath for bf16/fp16 too) with nvcc's default
math: the CUDA math library's expf (the code libdevice's `__nv_expf` holds), IEEE division, denormals kept.
It rounds to the dtype, and the multiply by `up` computes in fp32 and rounds again. The kernel takes the same
steps: libdevice exp (Triton's `tl.exp` is a bare ex2.approx), `div_rn` (its `/` is approximate), libdevice
without flush-to-zero, and no mul+add contraction.
Under Triton's interpreter (CPU), which cannot call libdevice, exp is numpy's, while torch's CPU silu uses its
own vectorized exp: the two differ in the last fp32 bit, so CPU results are close, not bitwise equal.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import libdevice

from .emulate import INTERPRETED
from .formats import as_rows
from .pdl import use_pdl, wait_for_producers

_BLOCK = 1024


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, o_ptr, n, stride_g, stride_u, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr,
                     PDL: tl.constexpr):
    wait_for_producers(PDL)
    row = tl.program_id(0).to(tl.int64)  # rows on axis 0: a prefill has more than axis 1's 65535
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + row * stride_g + offs, mask=mask, other=0.0)
    u = tl.load(u_ptr + row * stride_u + offs, mask=mask, other=0.0)
    tl.store(o_ptr + row * n + offs, silu_times(g, u, o_ptr.dtype.element_ty, LIBDEVICE), mask=mask)


@triton.jit
def silu_times(g, u, dt: tl.constexpr, LIBDEVICE: tl.constexpr):
    """silu(g) * u in dtype dt by torch's steps, for g and u holding dt values (of any float type): silu in fp32,
    rounded to dt, times u in fp32, rounded again. Callers launch with enable_fp_fusion=False and
    enable_reflect_ftz=False (see above)."""
    g = g.to(tl.float32)
    if LIBDEVICE:
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    act = tl.div_rn(g, 1.0 + e).to(dt).to(tl.float32)  # F.silu's output, rounded to the dtype
    return (act * u.to(tl.float32)).to(dt)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up for gate and up of one shape and dtype (bf16/fp16/fp32); returns a contiguous tensor.
    Rows may be strided (e.g. the gate and up slices of one fused projection's output): no copy is made when
    the last dim is contiguous and the leading dims flatten to rows."""
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(f"silu_mul needs gate and up of one shape, dtype and device, got {tuple(gate.shape)} "
                         f"{gate.dtype} {gate.device} and {tuple(up.shape)} {up.dtype} {up.device}")
    if gate.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"silu_mul supports bf16, fp16 and fp32, got {gate.dtype}")
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if out.numel():
        h = gate.shape[-1] if gate.dim() else 1
        g2, u2 = as_rows(gate, h), as_rows(up, h)
        grid = (g2.shape[0], triton.cdiv(h, _BLOCK))
        pdl = use_pdl(out.device)
        _silu_mul_kernel[grid](g2, u2, out, h, g2.stride(0), u2.stride(0), BLOCK=_BLOCK, LIBDEVICE=not INTERPRETED,
                               PDL=pdl, launch_pdl=pdl, num_warps=4, enable_fp_fusion=False,
                               enable_reflect_ftz=False)  # fmt: skip
    return out

