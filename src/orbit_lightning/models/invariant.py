"""Batch-invariant forward: what makes the engine's log-probs equal the trainer's bit for bit (issue 6).

A token's numbers must not depend on its batch. The ops whose torch/cuBLAS implementation picks its
reduction order from the shape (matmuls, RMSNorm, attention, logsumexp, short row sums) run here, in
`invariant_mode()`, through the Triton kernels' fixed-tile, never-split versions; elementwise ops are
invariant already. What each op needs:
- matmuls of plain weights (lm_head, adapters, routers): `F.linear` is intercepted by a TorchFunctionMode,
  so every nn.Linear and adapter follows without code changes; packed weights already dispatch to the
  fused kernel's invariant config (quant/dispatch.py);
- RMSNorm, logsumexp: one program per row (`kernels.rms_norm`, `kernels.logsumexp`);
- attention: key blocks counted from each sequence's first real token (`kernels.attention` /
  `kernels.paged_attention`), so prefill, left-padded teacher forcing and paged decode reduce alike;
- sums over a handful of columns (router weights): added column by column.
Outside the mode nothing changes, except that RMSNorm uses the one-kernel Triton version on CUDA (faster
at decode, and the trainer and engine share it). Backward passes stay torch's (recomputed from the
inputs): the guarantee is about forward values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from ..triton_kernels import kernels_module, kernels_run_on


def active() -> bool:
    """True inside `invariant_mode()` (or with the kernels' global switch on); never without Triton."""
    k = kernels_module()
    return k is not None and k.is_batch_invariant()


def use_kernels(x: Tensor) -> bool:
    """Whether an op on `x` takes the invariant kernels: in the mode, where they can run."""
    return active() and kernels_run_on(x.device)


def kernels_take(x: Tensor) -> bool:
    """Whether a one-launch kernel (RMSNorm, the fused elementwise ops) serves an op on `x`: on CUDA where the
    kernels run, and in the mode wherever they run (on the CPU, Triton's interpreter)."""
    return (x.is_cuda and kernels_run_on(x.device)) or use_kernels(x)


class _RecomputeBackward(torch.autograd.Function):
    """Forward by `fast` (a kernel without autograd); backward by differentiating `reference` (torch ops)
    recomputed from the saved inputs."""

    @staticmethod
    def forward(ctx, fast: Callable, reference: Callable, *inputs: Tensor) -> Tensor:
        ctx.reference = reference
        ctx.save_for_backward(*inputs)
        return fast(*inputs)

    @staticmethod
    def backward(ctx, grad: Tensor):
        inputs = ctx.saved_tensors
        wants = [i for i, t in enumerate(inputs) if ctx.needs_input_grad[2 + i]]
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(i in wants) for i, t in enumerate(inputs)]
            out = ctx.reference(*leaves)
        grads = torch.autograd.grad(out, [leaves[i] for i in wants], grad, allow_unused=True)
        full: list[Tensor | None] = [None] * len(inputs)
        for i, g in zip(wants, grads):
            full[i] = g
        return None, None, *full


def with_reference_grad(fast: Callable, reference: Callable, *inputs: Tensor) -> Tensor:
    """fast(*inputs), differentiable through `reference` when autograd needs it."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        return _RecomputeBackward.apply(fast, reference, *inputs)
    return fast(*inputs)


def _linear_reference(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    # matmul, not F.linear: the mode below intercepts F.linear, and a backward run in this thread would recurse.
    y = x @ w.t()
    return y if b is None else y + b


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ weight^T (+ bias) by the invariant kernel; gradients as F.linear's."""
    k = kernels_module()

    def fast(x_, w_, *b_):
        y = k.linear(x_, w_)
        return y + b_[0] if b_ else y

    inputs = (x, weight) if bias is None else (x, weight, bias)
    return with_reference_grad(fast, _linear_reference, *inputs)


class _InvariantLinear(TorchFunctionMode):
    """Routes F.linear on tensors the kernels can take to `linear`; everything else passes through."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            if (w.dim() == 2 and x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
                    and kernels_run_on(x.device) and w.device == x.device):
                return linear(x, w, b)
        return func(*args, **kwargs)


@contextlib.contextmanager
def invariant_mode(enabled: bool = True) -> Iterator[None]:
    """Batch-invariant forward in this thread: the kernels' fixed-tile mode plus the op routing above.
    `enabled=False` changes nothing (a convenience for callers that read the switch from a config)."""
    if not enabled:
        yield
        return
    k = kernels_module()
    if k is None:
        raise RuntimeError("batch-invariant mode needs orbit_lightning.kernels (Triton), which cannot be imported")
    with k.batch_invariant(True), _InvariantLinear():
        yield


def rms_norm(x: Tensor, weight: Tensor, eps: float, reference: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """RMSNorm by the one-row-per-program kernel on CUDA (and in the mode wherever the kernels run), else
    `reference(x, weight)`."""
    if not kernels_take(x):
        return reference(x, weight)
    k = kernels_module()
    return with_reference_grad(lambda x_, w_: k.rms_norm(x_, w_, eps), reference, x, weight)


def add_rms_norm(x: Tensor, h: Tensor, weight: Tensor, eps: float, reference: Callable[[Tensor, Tensor], Tensor]
                 ) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(x + h, RMSNorm(x + h)): one kernel where rms_norm takes the kernel and no autograd graph is needed (its
    result is bitwise the add followed by that kernel), else the add and rms_norm."""
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or h.requires_grad or weight.requires_grad)
    if needs_grad or not kernels_take(x) or h.dtype != x.dtype or h.shape != x.shape:
        s = x + h
        return s, rms_norm(s, weight, eps, reference)
    return kernels_module().add_rms_norm(x, h, weight, eps)


def logsumexp(x: Tensor) -> Tensor:
    """logsumexp over the last dim, fp32."""
    if not use_kernels(x):
        return x.float().logsumexp(-1)
    return with_reference_grad(kernels_module().logsumexp, lambda t: t.float().logsumexp(-1), x)


def sum_last(x: Tensor, keepdim: bool = False) -> Tensor:
    """Sum over a short last dim; in the mode column by column, an order no batch shape can change."""
    if not active():
        return x.sum(-1, keepdim=keepdim)
    total = x[..., 0]
    for j in range(1, x.shape[-1]):
        total = total + x[..., j]
    return total.unsqueeze(-1) if keepdim else total
