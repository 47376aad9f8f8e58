"""`invariant_mode`: op routing to the batch-invariant kernels, their gradients, and their row invariance.

On the CPU the kernels run in Triton's interpreter (fp32); bitwise row invariance on the GPU (bf16) is tested in
tests/kernels/test_gpu.py and tests/rollout/test_invariance.py.
"""

import pytest
import torch
import torch.nn.functional as F

from orbit_lightning.models.cache import left_padding
from orbit_lightning.models.invariant import active, invariant_mode, logsumexp, sum_last
from orbit_lightning.models.layers import RMSNorm

kernels = pytest.importorskip("orbit_lightning.kernels")
if not kernels.kernels_available("cpu"):
    pytest.skip("Triton's interpreter is off (TRITON_INTERPRET=1 must be set before import)", allow_module_level=True)


def test_mode_is_scoped_and_off_is_a_no_op():
    assert not active()
    with invariant_mode():
        assert active() and kernels.is_batch_invariant()
        with invariant_mode(False):  # "off" leaves an enclosing mode alone
            assert active()
    assert not active()


def test_linear_is_routed_to_the_kernel_in_the_mode_only():
    g = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(40, 24, bias=True)
    x = torch.randn(7, 40, generator=g)
    with torch.no_grad(), invariant_mode():
        y = layer(x)
    want = kernels.linear(x, layer.weight.detach()) + layer.bias.detach()
    assert torch.equal(y, want)
    assert torch.allclose(y, F.linear(x, layer.weight, layer.bias), atol=1e-5)  # fp32, K = 40 products


def test_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 72, generator=g)
    x = torch.randn(37, 72, generator=g)
    with invariant_mode():
        full = F.linear(x, w)
        norm_full = RMSNorm(72)(x)
        lse_full = logsumexp(x)
        for rows in (slice(0, 1), slice(5, 6), slice(3, 20)):
            assert torch.equal(F.linear(x[rows], w), full[rows])
            assert torch.equal(RMSNorm(72)(x[rows]), norm_full[rows])
            assert torch.equal(logsumexp(x[rows]), lse_full[rows])


def test_gradients_in_the_mode_equal_torch():
    """Forward by the kernels, backward by torch recomputation: the gradients are torch's (fp32, tight)."""
    g = torch.Generator().manual_seed(2)
    x0 = torch.randn(6, 32, generator=g)
    lin = torch.nn.Linear(32, 20)
    norm = RMSNorm(20)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)

    def loss():
        x = x0.clone().requires_grad_(True)
        out = logsumexp(norm(lin(x)) * 3).sum()
        out.backward()
        grads = [x.grad, lin.weight.grad, lin.bias.grad, norm.weight.grad]
        for p in (lin.weight, lin.bias, norm.weight):
            p.grad = None
        return out.detach(), grads

    ref_out, ref_grads = loss()
    with invariant_mode():
        out, grads = loss()
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    # The kernels sum in another order than torch (forward values differ in the last fp32 bits, ~1e-7 relative);
    # the upstream gradients move by that much and the ×3 logsumexp amplifies it ~10x in the worst element.
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_sum_last_adds_columns_in_order():
    x = torch.tensor([[1e8, 1.0, -1e8, 1.0]], dtype=torch.float32)
    with invariant_mode():
        c = x[0]
        assert sum_last(x).item() == (((c[0] + c[1]) + c[2]) + c[3]).item()  # fp32, left to right
        assert sum_last(x, keepdim=True).shape == (1, 1)


def test_left_padding_counts_and_rejects_holes():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1]])
    assert left_padding(mask).tolist() == [2, 0, 4]
    with pytest.raises(ValueError, match="one run of 1s"):
        left_padding(torch.tensor([[1, 0, 1, 1]]))


def test_checkpointed_logprobs_backward_in_the_mode():
    """The trainer's loss path: chunked, checkpointed log-probs whose backward recomputes each chunk outside the
    caller's mode (autograd does not carry it). Recomputed tensors must match, and gradients equal torch's."""
    import peft

    from orbit_lightning import add_adapter, load_model
    from orbit_lightning.models import token_logprobs

    model = load_model("tiny-qwen3", dtype=torch.float32)
    add_adapter(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0

    def grads():
        lp, _ = token_logprobs(model, ids, mask, start=2, chunk_rows=5)
        # Real query -> real target pairs only: a left-pad query attends to nothing in the kernel (zeros) and to
        # itself in torch's path; its output is never used.
        (lp * mask[:, 2:-1] * mask[:, 3:]).sum().backward()
        out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return out

    ref = grads()
    with invariant_mode():
        got = grads()
    assert ref.keys() == got.keys() and ref
    for name in ref:  # forward sums in another order (last fp32 bits), see test_gradients_in_the_mode_equal_torch
        torch.testing.assert_close(got[name], ref[name], rtol=1e-4, atol=1e-5)
