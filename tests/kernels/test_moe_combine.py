"""`kernels.moe_combine`, `slot_sum` and `moe_combine_backward` against torch's own ops on the same rows.

The oracle is torch computing what models.moe's combine always computed: the k slot rows gathered, each times its
weight in the dtype, summed slot by slot in the dtype; autograd differentiates it. The combine and the rows'
gradient round the same products the same way, so they must be bitwise equal (on the CPU in fp32/fp16: the
interpreter's bf16 casts truncate; on the GPU in bf16 too). Sums the kernels take in fp32 in another order (the
weights' gradient, slot_sum) are held to fp64 within the fp32 summation bound plus one rounding to the dtype.
"""

import pytest
import torch

from orbit_lightning import kernels
from tests.kernels.kernel_oracles import bits

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _case(t, k, d, e, dtype, device, seed=0):
    """Routed rows sorted by expert as models.moe sorts them: (ys, topk_w, order, inverse)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = torch.rand(t, e, generator=gen, device=device).topk(k, dim=-1).indices
    order = ids.reshape(-1).argsort(stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=device))
    ys = torch.randn(t * k, d, generator=gen, device=device).to(dtype)
    # Signed zeros in token 0's columns 0-2: all slots -0 (the sum must stay -0, since torch's first term is the
    # product itself, not 0 + it), the first slot alone -0, the first slot alone +0.
    slots = inverse[:k]
    ys[slots, 0] = -0.0
    ys[slots, 1:3] = 0.0
    ys[slots[0], 1] = -0.0
    w = torch.rand(t, k, generator=gen, device=device).softmax(-1).to(dtype)
    return ys, w, order, inverse


def _torch_combine(ys, w, inverse):
    t, k = w.shape
    y = ys[inverse].view(t, k, -1)
    out = y[:, 0] * w[:, 0:1]
    for j in range(1, k):
        out = out + y[:, j] * w[:, j : j + 1]
    return out


def _fp32_sum_bound(terms: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """|fp32 sum in any order - exact sum| <= (n - 1) eps32 sum |terms|, plus one rounding of the result to dtype."""
    n = terms.shape[dim]
    return (n - 1) * 2.0**-24 * terms.abs().sum(dim) + torch.finfo(dtype).eps * terms.sum(dim).abs()


def _check_combine(t, k, d, dtype, device):
    ys, w, order, inverse = _case(t, k, d, 16, dtype, device)
    ys.requires_grad_()
    w.requires_grad_()
    want = _torch_combine(ys, w, inverse)
    got = kernels.moe_combine(ys.detach(), inverse, w.detach())
    assert got.dtype == dtype and torch.equal(bits(got), bits(want))

    dout = torch.randn(want.shape, generator=torch.Generator(device=device).manual_seed(1), device=device).to(dtype)
    want.backward(dout)
    gys, gw = kernels.moe_combine_backward(dout, order, w.detach(), ys.detach())
    assert torch.equal(bits(gys), bits(ys.grad))  # dout[t] * w[t, j], rounded once: bitwise
    # grad_w: torch's products rounded to the dtype, summed in fp32 over D; the kernel rounds them alike
    prods = (dout.double()[order // k] * ys.detach().double()).to(dtype).double()  # [T k, D], sorted rows
    unsorted = torch.empty(2, t * k, dtype=torch.float64, device=device)
    unsorted.index_copy_(1, order, torch.stack([prods.sum(-1), _fp32_sum_bound(prods, 1, dtype)]))
    exact, bound = unsorted.view(2, t, k)
    assert ((gw.double() - exact).abs() <= bound).all()
    assert ((w.grad.double() - exact).abs() <= bound).all()  # (the same bound holds torch's own order)


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t,k,d", [(7, 4, 1500), (1, 8, 64), (5, 1, 24)], ids=["tail-block", "one-token", "k1"])
def test_combine_and_backward_cpu(dtype, t, k, d):
    _check_combine(t, k, d, dtype, "cpu")


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_slot_sum_cpu(dtype):
    t, k, d = 6, 4, 1100
    rows, _, _, inverse = _case(t, k, d, 8, dtype, "cpu")
    got = kernels.slot_sum(rows, inverse, k)
    terms = rows.double()[inverse].view(t, k, d)
    assert ((got.double() - terms.sum(1)).abs() <= _fp32_sum_bound(terms, 1, dtype)).all()


@pytest.mark.usefixtures("cpu_kernels")
def test_combine_empty_partial_strided_and_bad_inputs():
    ys, w, order, inverse = _case(3, 2, 40, 4, torch.float32, "cpu")
    dout = torch.randn(3, 40)
    gys, gw = kernels.moe_combine_backward(dout, order, w, ys)
    # each gradient alone, and strided inputs (rows of a wider buffer), give the same values
    assert torch.equal(kernels.moe_combine_backward(dout, order, w, ys, ys_grad=False)[1], gw)
    assert torch.equal(kernels.moe_combine_backward(dout, order, w)[0], gys)
    assert kernels.moe_combine_backward(dout, order, w)[1] is None
    wide = torch.randn(6, 50)
    wide[:, :40] = ys
    strided_w = torch.randn(3, 4)[:, ::2]
    strided_w.copy_(w)
    assert torch.equal(kernels.moe_combine(wide[:, :40], inverse, strided_w), kernels.moe_combine(ys, inverse, w))
    strided = kernels.moe_combine_backward(torch.randn(3, 50)[:, :40].copy_(dout), order, strided_w, wide[:, :40])
    assert torch.equal(strided[0], gys) and torch.equal(strided[1], gw)
    # no tokens, and no features (the weights' gradient is then 0)
    assert kernels.moe_combine(ys[:0], inverse[:0], w[:0]).shape == (0, 40)
    none = kernels.moe_combine_backward(dout[:0], order[:0], w[:0], ys[:0])
    assert none[0].shape == (0, 40) and none[1].shape == (0, 2)
    _, zero = kernels.moe_combine_backward(dout[:, :0], order, w, ys[:, :0])
    assert torch.equal(zero, torch.zeros(3, 2))
    with pytest.raises(ValueError, match="weights must be"):
        kernels.moe_combine(ys, inverse, w.half())
    with pytest.raises(ValueError, match="int64"):
        kernels.moe_combine(ys, inverse.int(), w)
    with pytest.raises(ValueError, match="slots of k"):
        kernels.slot_sum(ys, inverse, 4)
    with pytest.raises(ValueError, match="ys must be"):
        kernels.moe_combine_backward(dout, order, w, ys[:, :8])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_combine_and_backward_gpu(dtype):
    _check_combine(300, 8, 2048, dtype, "cuda")
    _check_combine(3, 6, 7168 + 8, dtype, "cuda")  # DeepSeek-V3 width with a tail
    _check_combine(5, 1, 64, dtype, "cuda")


@pytest.mark.gpu
@gpu
def test_slot_sum_gpu_many_tokens():
    t, k, d = 70000, 2, 64  # more tokens than a grid's second axis holds
    rows, _, _, inverse = _case(t, k, d, 8, torch.bfloat16, "cuda")
    got = kernels.slot_sum(rows, inverse, k)
    terms = rows.double()[inverse].view(t, k, d)
    assert ((got.double() - terms.sum(1)).abs() <= _fp32_sum_bound(terms, 1, torch.bfloat16)).all()
