"""The fused decode LoRA kernel against the two chained F.linear calls it replaces (interpreter, fp32/fp16)."""

import pytest
import torch
import torch.nn.functional as F

from orbit_lightning import kernels


def _reference(y, x, a, b, scale):
    return y + (F.linear(F.linear(x.to(a.dtype), a), b) * scale).to(y.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("m", "k", "n", "r"), [(1, 40, 70, 4), (5, 128, 64, 16), (17, 300, 33, 8), (3, 64, 130, 32)])
def test_lora_add_matches_chained_linears(dtype, m, k, n, r):
    g = torch.Generator().manual_seed(m + k)
    x, y = torch.randn(m, k, generator=g).to(dtype), torch.randn(m, n, generator=g).to(dtype)
    a, b = (0.1 * torch.randn(r, k, generator=g)).to(dtype), (0.1 * torch.randn(n, r, generator=g)).to(dtype)
    out = kernels.lora_add(y, x, a, b, 1.7)
    ref = _reference(y.double(), x.double(), a.double(), b.double(), 1.7)
    # fp32: sums of <= 300 products; fp16: the kernel rounds t and the delta to fp16 like the torch chain, so
    # both sit within a few fp16 ulps (2^-10 relative) of the fp64 value.
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=4e-3, atol=4e-3)
    torch.testing.assert_close(out.double(), ref, **tol)
    assert out.dtype == dtype and out.shape == y.shape


def test_lora_add_keeps_leading_dims_and_rejects_bad_shapes():
    x, y = torch.randn(2, 1, 32), torch.randn(2, 1, 48)
    a, b = torch.randn(4, 32), torch.randn(48, 4)
    assert kernels.lora_add(y, x, a, b, 1.0).shape == (2, 1, 48)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.lora_add(y, x, torch.randn(4, 31), b, 1.0)
    with pytest.raises(ValueError, match="decode batches"):
        kernels.lora_add(torch.randn(65, 48), torch.randn(65, 32), a, b, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("ns", [(70, 33), (64, 16, 16), (130, 1, 65)])
def test_lora_add_many_equals_one_lora_add_per_adapter(dtype, ns):
    # Side-by-side adapters (a fused q/k/v or gate/up): the same rounding steps per column as each adapter's own
    # lora_add, so the same bits; an output of width 1 and widths that are not tile multiples included.
    g = torch.Generator().manual_seed(sum(ns))
    m, k, r = 3, 96, 8
    x, y = torch.randn(m, k, generator=g).to(dtype), torch.randn(m, sum(ns), generator=g).to(dtype)
    a = [(0.1 * torch.randn(r, k, generator=g)).to(dtype) for _ in ns]
    b = [(0.1 * torch.randn(n, r, generator=g)).to(dtype) for n in ns]
    scales = [1.7, 0.5, 2.0][: len(ns)]
    out = kernels.lora_add_many(y, x, a, b, scales)
    parts = y.split(list(ns), dim=-1)
    want = torch.cat([kernels.lora_add(p, x, ag, bg, sg) for p, ag, bg, sg in zip(parts, a, b, scales)], dim=-1)
    assert torch.equal(out, want)
    ref = torch.cat([_reference(p.double(), x.double(), ag.double(), bg.double(), sg)
                     for p, ag, bg, sg in zip(parts, a, b, scales)], dim=-1)  # fmt: skip
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=4e-3, atol=4e-3)
    torch.testing.assert_close(out.double(), ref, **tol)
    with pytest.raises(ValueError, match="add up"):
        kernels.lora_add_many(y[:, 1:], x, a, b, scales)
    with pytest.raises(ValueError, match="1 to 3"):
        kernels.lora_add_many(y, x, a * 2, b * 2, scales * 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 16, 64])
def test_lora_add_bf16_gpu(m):
    g = torch.Generator(device="cuda").manual_seed(m)
    k, n, r = 4096, 1024, 16
    x, y = torch.randn(m, k, generator=g, device="cuda"), torch.randn(m, n, generator=g, device="cuda")
    a, b = 0.02 * torch.randn(r, k, generator=g, device="cuda"), 0.02 * torch.randn(n, r, generator=g, device="cuda")
    bf = [t.bfloat16() for t in (y, x, a, b)]
    out = kernels.lora_add(*bf, 2.0)
    ref = _reference(*(t.double() for t in bf), 2.0)
    torch_bf16 = _reference(*bf, 2.0)
    # Both bf16 paths round t, the delta and the sum to bf16 (2^-8 relative); the fused kernel must be as close
    # to the fp64 value as the torch chain it replaces, up to one more rounding of |y| ~ 3.
    err, base = (out.double() - ref).abs().max().item(), (torch_bf16.double() - ref).abs().max().item()
    assert err <= base + 2 ** -8 * 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 16])
def test_lora_add_many_bf16_gpu_is_bitwise_per_adapter(m):
    g = torch.Generator(device="cuda").manual_seed(m)
    k, ns, r = 4096, (4096, 1024, 1024), 16
    x, y = torch.randn(m, k, generator=g, device="cuda").bfloat16(), torch.randn(m, 6144, generator=g, device="cuda")
    a = [(0.02 * torch.randn(r, k, generator=g, device="cuda")).bfloat16() for _ in ns]
    b = [(0.02 * torch.randn(n, r, generator=g, device="cuda")).bfloat16() for n in ns]
    out = kernels.lora_add_many(y.bfloat16(), x, a, b, [2.0, 1.0, 0.5])
    parts = y.bfloat16().split(list(ns), dim=-1)
    want = torch.cat([kernels.lora_add(p, x, ag, bg, s) for p, ag, bg, s in zip(parts, a, b, [2.0, 1.0, 0.5])], -1)
    assert torch.equal(out, want)
