"""RoPE and SwiGLU's one-launch kernels inside a model: a forward without autograd (kernels) equals one with
autograd (torch ops) bit for bit.

Both forwards run in batch-invariant mode, so every other op takes the same kernel either way and only the
elementwise chains differ. On the CPU that covers RoPE (through Triton's interpreter, fp32); SwiGLU's kernel
runs on CUDA only, so the GPU test (bf16) covers both.
"""

import pytest
import torch

from orbit_lightning import load_model
from orbit_lightning.models.invariant import invariant_mode
from orbit_lightning.models.layers import apply_rope, apply_rope_qk, rope_reference

kernels = pytest.importorskip("orbit_lightning.kernels")
interpreter = pytest.mark.skipif(not kernels.kernels_available("cpu"),
                                 reason="Triton's interpreter is off (TRITON_INTERPRET=1 must be set before import)")


@pytest.fixture
def calls(monkeypatch):
    """Counts of kernels.rope / kernels.silu_mul calls (the model looks them up at call time)."""
    counts = {"rope": 0, "silu_mul": 0}
    for name in counts:
        real = getattr(kernels, name)

        def spy(*args, _real=real, _name=name, **kw):
            counts[_name] += 1
            return _real(*args, **kw)

        monkeypatch.setattr(kernels, name, spy)
    return counts


def _forwards(preset: str, device: str, dtype: torch.dtype, calls: dict):
    model = load_model(preset, dtype=dtype, device=device)
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0)).to(device)
    with invariant_mode():
        torch_ops = model.hidden_states(ids)
        assert torch_ops.requires_grad and not any(calls.values())  # autograd: the torch path
        with torch.no_grad():
            fused = model.hidden_states(ids)
    return fused, torch_ops.detach()


@interpreter
@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-deepseek-v3"])  # rotate-half GQA, interleaved MLA
def test_no_grad_forward_equals_autograd_forward_cpu(preset, calls):
    fused, torch_ops = _forwards(preset, "cpu", torch.float32, calls)
    assert calls["rope"] > 0 and torch.equal(fused, torch_ops)


@interpreter
def test_cpu_outside_the_mode_keeps_torch_ops(calls):
    """The interpreter is slow: outside the mode the CPU keeps torch's ops (as RMSNorm does)."""
    x, cos, sin = torch.randn(1, 2, 3, 8), torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    with torch.no_grad():
        assert torch.equal(apply_rope(x, cos, sin), rope_reference(x, cos, sin))
    assert calls["rope"] == 0


@interpreter
def test_apply_rope_qk_is_one_launch(calls):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 4, 16, generator=gen).transpose(1, 2)
    k = torch.randn(2, 3, 1, 16, generator=gen).transpose(1, 2)
    cos, sin = torch.randn(2, 3, 16, generator=gen), torch.randn(2, 3, 16, generator=gen)
    with torch.no_grad(), invariant_mode():
        qo, ko = apply_rope_qk(q, k, cos, sin)
    assert calls["rope"] == 1
    assert torch.equal(qo, rope_reference(q, cos, sin)) and torch.equal(ko, rope_reference(k, cos, sin))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-deepseek-v3"])
def test_no_grad_forward_equals_autograd_forward_gpu(preset, calls):
    fused, torch_ops = _forwards(preset, "cuda", torch.bfloat16, calls)
    assert calls["rope"] > 0 and calls["silu_mul"] > 0 and torch.equal(fused, torch_ops)
