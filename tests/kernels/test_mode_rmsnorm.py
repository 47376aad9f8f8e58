"""Batch-invariant switch, config selection, and the row-wise RMSNorm kernel."""

import threading

import pytest
import torch

from orbit_lightning import kernels


def test_switch_and_context_manager_nest_and_restore():
    assert not kernels.is_batch_invariant()
    with kernels.batch_invariant():
        assert kernels.is_batch_invariant()
        with kernels.batch_invariant(False):
            assert not kernels.is_batch_invariant()
        assert kernels.is_batch_invariant()
    assert not kernels.is_batch_invariant()
    kernels.set_batch_invariant(True)
    try:
        assert kernels.is_batch_invariant()
        seen = []
        thread = threading.Thread(target=lambda: seen.append(kernels.is_batch_invariant()))
        thread.start()
        thread.join()
        assert seen == [True]  # the global switch is process-wide
    finally:
        kernels.set_batch_invariant(False)
    with pytest.raises(TypeError, match="bool"):
        kernels.set_batch_invariant(1)


def test_invariant_configs_do_not_depend_on_m():
    cuda = torch.device("cuda", 0)  # config selection needs no GPU
    pick_config = kernels.configs.pick_config
    fast = {pick_config("fwd", m, cuda) for m in (1, 16, 64, 256, 4096)}
    assert len(fast) > 1 and any(c.split_k != 1 for c in fast)  # the fast mode does specialize
    with kernels.batch_invariant():
        for kind in ("fwd", "dx", "grouped_fwd", "grouped_dx"):
            chosen = {pick_config(kind, m, cuda) for m in (1, 7, 64, 65, 4096, 16384)}
            assert len(chosen) == 1 and chosen.pop().split_k == 1
        # dense and MoE forward share one config, so a row is reduced identically on both paths
        assert pick_config("fwd", 3, cuda) == pick_config("grouped_fwd", 300, cuda)
    # fp32 activations use one small FMA-friendly config at every M, in either mode
    assert len({pick_config("fwd", m, cuda, torch.float32) for m in (1, 64, 4096)}) == 1


def test_the_long_k_decode_config_serves_17_to_64_rows_of_the_fast_forward():
    cuda, pick_config, long_k = torch.device("cuda", 0), kernels.configs.pick_config, kernels.configs.LONG_K
    for m in (17, 64):
        assert pick_config("fwd", m, cuda, int4_r=long_k) is kernels.configs._FWD_LONG_K
        assert pick_config("fwd", m, cuda, int4_r=long_k - 128) == pick_config("fwd", m, cuda)
    for m in (16, 65):
        assert pick_config("fwd", m, cuda, int4_r=long_k) == pick_config("fwd", m, cuda)
    assert pick_config("dx", 64, cuda, int4_r=long_k) == pick_config("dx", 64, cuda)
    with kernels.batch_invariant():
        assert pick_config("fwd", 64, cuda, int4_r=long_k) == pick_config("fwd", 64, cuda)


def _rms_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Qwen3RMSNorm semantics in float64: normalize, round to x.dtype, scale by the weight."""
    xd = x.double()
    normed = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return w.double() * normed.double()


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_matches_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 2, 1100, generator=gen) * 3).to(dtype)  # H not a power of two: a masked tail
    w = (1 + 0.1 * torch.randn(1100, generator=gen)).to(dtype)
    y = kernels.rms_norm(x, w, eps=1e-6)
    ref = _rms_ref(x, w, 1e-6)
    assert y.shape == x.shape and y.dtype == dtype
    # fp32: only accumulation-order differences (~1e-6 relative); fp16: the intermediate may round to a
    # neighbouring fp16 value (2^-10 relative) and the output rounds once more.
    rel = 1e-5 if dtype == torch.float32 else 2.0**-9
    assert ((y.double() - ref).abs() <= rel * ref.abs() + 1e-7).all()
    with pytest.raises(ValueError, match=r"\[H\]"):
        kernels.rms_norm(x, w[:-1])


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_add_rms_norm_is_the_add_then_the_norm(dtype):
    # One launch for a residual add and the next norm: the same bits as torch's add followed by rms_norm.
    gen = torch.Generator().manual_seed(1)
    x, h = ((torch.randn(2, 3, 300, generator=gen) * 3).to(dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(300, generator=gen)).to(dtype)
    total, y = kernels.add_rms_norm(x, h[:, :, :], w, eps=1e-6)
    assert torch.equal(total, x + h)
    assert torch.equal(y, kernels.rms_norm(x + h, w, eps=1e-6))
    with pytest.raises(ValueError, match="one shape"):
        kernels.add_rms_norm(x, h[..., :-1], w)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 300])
def test_add_rms_norm_gpu_bf16_bitwise(rows):
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x, h = ((torch.randn(rows, 4096, generator=gen, device="cuda") * 2).bfloat16() for _ in range(2))
    w = (1 + 0.1 * torch.randn(4096, generator=gen, device="cuda")).bfloat16()
    total, y = kernels.add_rms_norm(x, h, w, eps=1e-6)
    assert torch.equal(total, x + h) and torch.equal(y, kernels.rms_norm(x + h, w, eps=1e-6))
