"""`kernels.silu_mul` against `F.silu(gate) * up`.

On the GPU: bitwise, over every bf16 and fp16 gate value (the op is elementwise, so that covers each dtype
completely) and a large fp32 sample. On the CPU the interpreter's exp is numpy's, not torch's, so the kernel is
checked bitwise against torch's rounding steps with numpy's exp, and to within one ulp against F.silu.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from orbit_lightning import kernels
from tests.kernels.kernel_oracles import bits

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _torch_steps_with_numpy_exp(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """torch's CUDA silu recipe, x / (1 + exp(-x)) in fp32 rounded to the dtype, then the rounded product."""
    g = gate.float()
    act = (g / (1 + torch.from_numpy(np.exp(-g.numpy())))).to(gate.dtype)
    return (act.float() * up.float()).to(gate.dtype)


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1, 1000), (3, 2500)], ids=["decode", "rows-with-tail"])
def test_silu_mul_cpu(dtype, shape):
    gen = torch.Generator().manual_seed(0)
    gate = (torch.randn(shape, generator=gen) * 6).to(dtype)
    up = (torch.randn(shape, generator=gen) * 2).to(dtype)
    out = kernels.silu_mul(gate, up)
    assert out.shape == gate.shape and out.dtype == dtype
    assert torch.equal(out, _torch_steps_with_numpy_exp(gate, up))
    # torch's CPU exp may differ in the last fp32 bit, which can flip a rounding: a few ulps at most.
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=2 * eps, atol=torch.finfo(dtype).tiny)


@pytest.mark.usefixtures("cpu_kernels")
def test_silu_mul_noncontiguous_empty_and_bad_inputs():
    gen = torch.Generator().manual_seed(1)
    gate, up = torch.randn(40, 24, generator=gen).t(), torch.randn(40, 24, generator=gen).t()
    out = kernels.silu_mul(gate, up)
    assert out.is_contiguous() and torch.equal(out, _torch_steps_with_numpy_exp(gate, up))
    assert kernels.silu_mul(gate[:0], up[:0]).shape == (0, 40)
    fused = torch.randn(2, 3, 64, generator=gen)  # gate | up side by side, as one fused projection writes them
    g, u = fused[..., :32], fused[..., 32:]
    assert torch.equal(kernels.silu_mul(g, u), _torch_steps_with_numpy_exp(g.contiguous(), u.contiguous()))
    with pytest.raises(ValueError, match="one shape"):
        kernels.silu_mul(gate, up[:, :3])
    with pytest.raises(TypeError, match="bf16"):
        kernels.silu_mul(gate.double(), up.double())


def _assert_bitwise(got: torch.Tensor, want: torch.Tensor):
    """Equal bit patterns (so signed zeros count), NaN payloads aside."""
    same = (bits(got) == bits(want)) | (got.isnan() & want.isnan())
    assert same.all(), f"{(~same).sum().item()} differ, e.g. gate bits {bits(got)[~same][:4].tolist()}"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_mul_every_value_gpu(dtype):
    gate = torch.arange(-(2**15), 2**15, dtype=torch.int32, device="cuda").to(torch.int16).view(dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for up in (torch.ones_like(gate), torch.randn(gate.shape, generator=gen, device="cuda").to(dtype)):
        _assert_bitwise(kernels.silu_mul(gate, up), F.silu(gate) * up)


@pytest.mark.gpu
@gpu
def test_silu_mul_fp32_gpu():
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate = torch.randn(1 << 22, generator=gen, device="cuda") * 30
    gate[:6] = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 100.0, -100.0])  # denormals, exp over/underflow
    up = torch.randn(gate.shape, generator=gen, device="cuda")
    _assert_bitwise(kernels.silu_mul(gate, up), F.silu(gate) * up)


@pytest.mark.gpu
@gpu
def test_silu_mul_gpu_many_strided_rows():
    # more rows than a grid's second axis holds (65535), read in place from a fused gate|up output
    fused = torch.randn(70000, 2, 96, device="cuda").bfloat16()
    g, u = fused[:, 0], fused[:, 1]
    _assert_bitwise(kernels.silu_mul(g, u), F.silu(g) * u)
