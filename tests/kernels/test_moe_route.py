"""Softmax top-k routing in one launch (kernels/moe_route.py) against a float64 oracle: under the interpreter (fp32
and fp16 logits) and on the GPU (bf16 too, every Qwen3-style expert count), and the model's router on both paths.

Logits are a shuffled ladder (experts 0.05 apart, plus noise below 0.01, the largest near 0), so no two of a row's
leading probabilities are within rounding of each other, even from bf16 logits: the chosen experts must equal the
oracle's exactly.
Weight bound: the probabilities are exp(l - max) / sum in fp32; exp (at most 2 ulp, plus the rounding of its
argument, up to |l - max| ulp) and the E-term sum (E ulp) give 2^-24 (E + 2 |l - max| + 4) relative; the
renormalization by a k-term sum adds k + 1 ulp; the stored dtype rounds once more (2^-8 bf16, 2^-11 fp16).
"""

import pytest
import torch

from orbit_lightning import kernels
from tests.kernels.kernel_oracles import gpu

cpu = pytest.mark.usefixtures("cpu_kernels")


def _logits(t: int, e: int, seed: int, dtype=torch.float32, device="cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ladder = torch.stack([torch.randperm(e, generator=gen) for _ in range(t)]).double() * 0.05
    noise = torch.rand(t, e, generator=gen, dtype=torch.float64) * 0.01
    return (ladder + noise - 0.05 * e).to(dtype).to(device)  # the largest near 0, where bf16 resolves them


def _oracle(logits: torch.Tensor, k: int, renormalize: bool):
    probs = logits.double().softmax(-1)
    w, ids = probs.topk(k, dim=-1)
    return (w / w.sum(-1, keepdim=True) if renormalize else w), ids


def _check(logits, k, renormalize, out_dtype):
    w, ids = kernels.softmax_topk(logits, k, renormalize, out_dtype)
    ref_w, ref_ids = _oracle(logits.cpu(), k, renormalize)
    assert w.dtype == out_dtype and ids.dtype == torch.int64 and w.shape == ids.shape == (logits.shape[0], k)
    assert torch.equal(ids.cpu(), ref_ids)
    e = logits.shape[-1]
    spread = (logits.double().max(-1, keepdim=True).values - logits.double()).gather(1, ids).cpu()
    rel = 2.0**-24 * (e + 2 * spread + 4 + (k + 1 if renormalize else 0))
    rel = rel + {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[out_dtype]
    err = (w.cpu().double() - ref_w).abs()
    assert (err <= rel * ref_w).all(), f"max error {(err / ref_w).max():.3e} relative"


@cpu
@pytest.mark.parametrize("e,k", [(128, 8), (60, 4), (8, 2), (5, 1)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_topk_matches_fp64(e, k, renormalize):
    for t, seed in ((1, 0), (37, 1)):  # one row; rows over several programs with a partial last block
        _check(_logits(t, e, seed), k, renormalize, torch.float32)
    _check(_logits(9, e, 2, torch.float16), k, renormalize, torch.float16)


@cpu
def test_softmax_topk_ties_and_non_finite_rows():
    """Equal probabilities pick the lowest experts first; a row with a NaN or +inf logit (all NaN after the softmax,
    as in torch) or of all -inf still names k distinct valid experts, with NaN weights, as torch.topk does."""
    logits = torch.zeros(4, 6)
    logits[1, 3] = float("nan")
    logits[2, 4] = float("inf")
    logits[3] = float("-inf")
    w, ids = kernels.softmax_topk(logits, 4, True, torch.float32)
    assert ids[0].tolist() == [0, 1, 2, 3] and torch.allclose(w[0], torch.full((4,), 0.25))
    for row in ids[1:]:
        assert row.unique().numel() == 4 and 0 <= row.min() and row.max() < 6
    assert w[1:].isnan().all()


@cpu
def test_softmax_topk_rejects_what_it_cannot_pick():
    logits = torch.randn(4, 16)
    with pytest.raises(ValueError, match="power-of-two k"):
        kernels.softmax_topk(logits, 3, True, torch.float32)
    with pytest.raises(ValueError, match="power-of-two k"):
        kernels.softmax_topk(logits, 32, True, torch.float32)
    with pytest.raises(ValueError, match=r"\[tokens, experts\]"):
        kernels.softmax_topk(logits[None], 2, True, torch.float32)
    with pytest.raises(ValueError, match="writes bf16/fp16/fp32"):
        kernels.softmax_topk(logits, 2, True, torch.int32)
    w, ids = kernels.softmax_topk(logits[:0], 2, True, torch.float32)
    assert w.shape == ids.shape == (0, 2)


@gpu
@pytest.mark.parametrize("e,k", [(128, 8), (60, 4), (384, 8), (512, 2)])
def test_gpu_softmax_topk_matches_fp64(e, k):
    for t, dtype, out in ((1, torch.bfloat16, torch.bfloat16), (300, torch.bfloat16, torch.bfloat16),
                          (4099, torch.float32, torch.float32), (17, torch.float16, torch.float16)):  # fmt: skip
        for renormalize in (True, False):
            _check(_logits(t, e, t, dtype, "cuda"), k, renormalize, out)


def _router_paths(device, dtype, monkeypatch, force=False):
    """models.moe.SoftmaxRouter with the kernel (which must run) against torch's ops: the same experts, weights
    within the dtype's rounding, and the same gradients for x and the router weight (torch's formula differentiated
    on both paths)."""
    from orbit_lightning.models import moe
    from orbit_lightning.models.config import ModelConfig

    cfg = ModelConfig("qwen3_moe", vocab_size=32, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, num_experts=60, num_experts_per_tok=4,
                      moe_intermediate_size=32, norm_topk_prob=True)
    router = moe.SoftmaxRouter(cfg)
    torch.nn.init.normal_(router.weight, std=0.5, generator=torch.Generator().manual_seed(0))
    router = router.to(device, dtype)
    x = torch.randn(33, 64, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    calls = []
    monkeypatch.setattr(kernels, "softmax_topk", lambda *a: calls.append(1) or kernels.moe_route.softmax_topk(*a))
    runs = []
    for kernel in (True, False):
        monkeypatch.setattr(moe, "KERNEL_ROUTE", kernel)
        if force:  # the CPU: the interpreter runs the kernel where the model would not take it
            monkeypatch.setattr(moe, "_kernel_route", lambda logits, k, on=kernel: on)
        xg = x.clone().requires_grad_()
        router.weight.grad = None
        w, ids = router(xg)
        (w.float() * torch.arange(1, 5, device=device)).sum().backward()
        runs.append((w.detach(), ids, xg.grad, router.weight.grad))
        assert len(calls) == int(kernel)
        calls.clear()
    (w0, ids0, dx0, dr0), (w1, ids1, dx1, dr1) = runs
    assert torch.equal(ids0, ids1)
    torch.testing.assert_close(w0, w1, rtol=2**-8 if dtype == torch.bfloat16 else 2**-20, atol=0)
    torch.testing.assert_close(dx0, dx1)
    torch.testing.assert_close(dr0, dr1)  # the router's own gradient (the base's router, if it were trained)


@cpu
def test_router_kernel_path_matches_torchs_and_backpropagates(monkeypatch):
    _router_paths("cpu", torch.float32, monkeypatch, force=True)


@gpu
def test_gpu_router_kernel_path_matches_torchs_and_backpropagates(monkeypatch):
    _router_paths("cuda", torch.bfloat16, monkeypatch)
