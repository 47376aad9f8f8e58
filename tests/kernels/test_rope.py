"""`kernels.rope` against `models.layers.apply_rope`'s torch ops: bitwise, in both layouts, for q and k at once.

On the CPU (Triton's interpreter) in fp32 and fp16; bf16 only on the GPU (the interpreter's bf16 casts truncate).
"""

import pytest
import torch

from orbit_lightning import kernels
from orbit_lightning.models.layers import rope_reference

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _tables(b: int, t: int, d: int, gen: torch.Generator, device="cpu"):
    """cos/sin [B, T, d] as `Rotary` builds them, at scattered large positions (many distinct roundings)."""
    pos = torch.randint(0, 40_000, (b, t), generator=gen).float()
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2).float() / d))
    emb = (pos[..., None] * inv_freq).repeat(1, 1, 2)
    return emb.cos().to(device), emb.sin().to(device)


def _heads(b: int, t: int, h: int, d: int, dtype, gen, device="cpu", pad: int = 0):
    """[B, H, T, d] as the model makes it: a transposed view of [B, T, H, d] (with `pad` leading columns per head
    split off, as MLA's q_rot is)."""
    x = (torch.randn(b, t, h, pad + d, generator=gen) * 4).to(dtype).to(device)
    return x.transpose(1, 2)[..., pad:]


def _check(q, k, cos, sin, interleave):
    qo, ko = kernels.rope(q, k, cos, sin, interleave)
    for got, x in ((qo, q), (ko, k)):
        want = rope_reference(x, cos, sin, interleave)
        assert got.dtype == want.dtype and torch.equal(got, want)
        if x.shape[1] > 1 and x.shape[2] > 1:  # strides of size-1 dims carry no layout
            assert got.stride() == want.stride()


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize(
    "b, t, h, hkv, d",
    [(1, 1, 8, 2, 128), (2, 5, 4, 4, 64), (2, 3, 6, 1, 64), (1, 4, 3, 1, 24)],
    ids=["decode-gqa-128", "prefill-mha-64", "prefill-mqa-64", "non-pow2-d"],
)
def test_rope_matches_torch_bitwise(dtype, interleave, b, t, h, hkv, d):
    gen = torch.Generator().manual_seed(b * 100 + t * 10 + d)
    q, k = _heads(b, t, h, d, dtype, gen), _heads(b, t, hkv, d, dtype, gen)
    _check(q, k, *_tables(b, t, d, gen), interleave)


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_mla_views(dtype):
    """MLA: q_rot is the tail of each head (a non-dense view), k_rot one shared head viewed from [B, T, r]."""
    gen = torch.Generator().manual_seed(7)
    b, t, h, nope, r = 2, 3, 4, 16, 8
    q_rot = _heads(b, t, h, r, dtype, gen, pad=nope)
    k_rot = (torch.randn(b, t, 32 + r, generator=gen) * 4).to(dtype)[..., 32:].view(b, 1, t, r)
    _check(q_rot, k_rot, *_tables(b, t, r, gen), interleave=True)


@pytest.mark.usefixtures("cpu_kernels")
def test_rope_q_alone_and_broadcast_batch():
    gen = torch.Generator().manual_seed(3)
    q = _heads(3, 2, 4, 32, torch.float32, gen)
    cos, sin = _tables(1, 2, 32, gen)  # one table for every batch row
    qo, ko = kernels.rope(q, None, cos, sin)
    assert ko is None and torch.equal(qo, rope_reference(q, cos, sin, False))


@pytest.mark.usefixtures("cpu_kernels")
def test_rope_rejects_bad_inputs():
    gen = torch.Generator().manual_seed(0)
    q = _heads(1, 2, 2, 8, torch.float32, gen)
    cos, sin = _tables(1, 2, 8, gen)
    with pytest.raises(TypeError, match="one dtype"):
        kernels.rope(q, q.half(), cos, sin)
    with pytest.raises(ValueError, match="even head dim"):
        kernels.rope(q[..., :7], None, cos[..., :7], sin[..., :7])
    with pytest.raises(ValueError, match=r"\[B, H, T, d\]"):
        kernels.rope(q, q[:, :, :1], cos, sin)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("b, t", [(1, 1), (4, 1), (3, 37)])
def test_rope_matches_torch_bitwise_gpu(dtype, interleave, b, t):
    """Qwen3-8B heads (32 q, 8 kv, d 128) and an MLA-like rope dim (64, one shared k head)."""
    gen = torch.Generator().manual_seed(t)
    for h, hkv, d in ((32, 8, 128), (16, 1, 64)):
        q, k = _heads(b, t, h, d, dtype, gen, "cuda"), _heads(b, t, hkv, d, dtype, gen, "cuda")
        _check(q, k, *_tables(b, t, d, gen, "cuda"), interleave)


def _norm_rope_oracle(x, w, cos, sin, eps):
    """float64 RoPE (rotate-half) of Qwen3's per-head RMSNorm of x [B, H, T, d], with cos/sin rounded to x's dtype as
    the kernel and apply_rope round them, and the magnitude |n| |cos| + |rot n| |sin| that bounds its rounding error."""
    xd = x.double()
    n = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    c, s = cos[:, None].to(x.dtype).double(), sin[:, None].to(x.dtype).double()
    n1, n2 = n.chunk(2, dim=-1)
    ref = n * c + torch.cat((-n2, n1), dim=-1) * s
    return ref, n.abs() * c.abs() + torch.cat((n2, n1), dim=-1).abs() * s.abs()


def _check_norm_rope(q, k, cos, sin, wq, wk, eps, mantissa_bits):
    """Five roundings to x's dtype (the normed value, its weight product, the two rotation products, their sum) and
    the fp32 rstd (2^-23, ~1 ulp more in fp32): 7 ulps of the magnitude bound every output."""
    qo, ko = kernels.rope(q, k, cos, sin, norm_weights=(wq, wk), eps=eps)
    for got, x, w in ((qo, q, wq), (ko, k, wk)):
        ref, mag = _norm_rope_oracle(x.cpu(), w.cpu(), cos.cpu(), sin.cpu(), eps)
        assert got.dtype == x.dtype
        err = (got.cpu().double() - ref).abs()
        assert (err <= 7 * 2.0**-mantissa_bits * mag + 1e-30).all(), f"max error {err.max().item():.3e}"
    return qo, ko


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("dtype, bits", [(torch.float32, 24), (torch.float16, 11)], ids=["fp32", "fp16"])
@pytest.mark.parametrize("b, t, h, hkv, d", [(1, 1, 8, 2, 128), (2, 3, 4, 1, 64)], ids=["decode", "prefill"])
def test_rope_with_qk_norm_matches_fp64(dtype, bits, b, t, h, hkv, d):
    gen = torch.Generator().manual_seed(11 + t)
    q, k = _heads(b, t, h, d, dtype, gen), _heads(b, t, hkv, d, dtype, gen)
    wq, wk = [(torch.rand(d, generator=gen) + 0.5).to(dtype) for _ in range(2)]
    _check_norm_rope(q, k, *_tables(b, t, d, gen), wq, wk, 1e-6, bits)
    with pytest.raises(ValueError, match="norm_weights"):
        kernels.rope(q, k, *_tables(b, t, d, gen), norm_weights=(wq[:-2], wk))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("b, t", [(1, 1), (16, 1), (2, 37)])
def test_rope_with_qk_norm_bf16_gpu(b, t):
    """Qwen3-8B heads: against the fp64 oracle, and within the same bound of the two-launch path (rms_norm, rope)."""
    gen = torch.Generator().manual_seed(5 + t)
    q, k = _heads(b, t, 32, 128, torch.bfloat16, gen, "cuda"), _heads(b, t, 8, 128, torch.bfloat16, gen, "cuda")
    wq, wk = [(torch.rand(128, generator=gen) + 0.5).bfloat16().cuda() for _ in range(2)]
    cos, sin = _tables(b, t, 128, gen, "cuda")
    qo, ko = _check_norm_rope(q, k, cos, sin, wq, wk, 1e-6, 8)
    two = kernels.rope(kernels.rms_norm(q, wq, 1e-6), kernels.rms_norm(k, wk, 1e-6), cos, sin)
    for got, sep, x, w in ((qo, two[0], q, wq), (ko, two[1], k, wk)):
        _, mag = _norm_rope_oracle(x.cpu(), w.cpu(), cos.cpu(), sin.cpu(), 1e-6)
        assert ((got.cpu().double() - sep.cpu().double()).abs() <= 14 * 2.0**-8 * mag + 1e-30).all()
