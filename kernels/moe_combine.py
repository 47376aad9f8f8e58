"""The MoE combine in one launch, its backward in one more, and the dispatch's backward (a token's k slot rows
summed) in one.

Rows arrive sorted by expert; row inverse[t * k + j] holds token t's slot j (`order` is the inverse permutation).
- `moe_combine`: out[t] = sum over j = 0..k-1 of w[t, j] * ys[inverse[t * k + j]], rounded to the dtype after every
  product and every sum: the steps torch takes for models.moe's `y_j * w_j + ...` (fp32 opmath, round to nearest
  even, no contraction), so the two are bitwise equal on CUDA. Torch needs a gather and 2k - 1 launches, each
  through its non-vectorized broadcast kernel, and autograd keeps the k gathered slot copies; here the k rows are
  read in place.
- `slot_sum`: out[t] = the k rows summed in fp32, rounded once: `rows[inverse].view(T, k, D).sum(1)` without
  writing the gathered copy (equal up to the order of the fp32 sum, and the sign of an all-zero sum: torch starts
  from +0, this from the first row).
- `moe_combine_backward`: per sorted row r, (t, j) = divmod(order[r], k): grad_ys[r] = dout[t] * w[t, j] (torch's
  rounding, bitwise) and grad_w[t, j] = sum over d of dout[t, d] * ys[r, d], each product rounded to the dtype and
  the sum in fp32 (torch's steps; the order of the fp32 sum differs).
Every output element is reduced in a fixed order, whatever the batch: batch-invariant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .pdl import use_pdl, wait_for_producers

_BLOCK = 1024
COMBINE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # the rows the combine kernels take


@triton.jit
def _slot_sum_kernel(rows_ptr, inv_ptr, w_ptr, out_ptr, D, K, stride_r, stride_w, stride_o,
                     WEIGHTED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_producers(PDL)
    t = tl.program_id(0).to(tl.int64)  # tokens on axis 0: a prefill has more than axis 1's 65535
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    dt: tl.constexpr = out_ptr.dtype.element_ty
    # Slot 0 starts the sum (torch's first term is the product itself; 0 + -0.0 would flip a sign).
    r = tl.load(inv_ptr + t * K)
    acc = tl.load(rows_ptr + r * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    if WEIGHTED:
        acc = (acc * tl.load(w_ptr + t * stride_w).to(tl.float32)).to(dt).to(tl.float32)
    for j in range(1, K):
        r = tl.load(inv_ptr + t * K + j)
        y = tl.load(rows_ptr + r * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        if WEIGHTED:
            p = (y * tl.load(w_ptr + t * stride_w + j).to(tl.float32)).to(dt).to(tl.float32)
            acc = (acc + p).to(dt).to(tl.float32)
        else:
            acc += y
    tl.store(out_ptr + t * stride_o + offs, acc.to(dt), mask=mask)


@triton.jit
def _combine_backward_kernel(dout_ptr, ys_ptr, order_ptr, w_ptr, gys_ptr, gw_ptr, D, K, stride_d, stride_y, stride_w,
                             stride_g, YS_GRAD: tl.constexpr, W_GRAD: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    o = tl.load(order_ptr + r).to(tl.int64)
    t = o // K
    w = tl.load(w_ptr + t * stride_w + o % K).to(tl.float32)
    dt: tl.constexpr = dout_ptr.dtype.element_ty
    s = tl.zeros((BLOCK,), tl.float32)
    for d0 in range(0, D, BLOCK):
        offs = d0 + tl.arange(0, BLOCK)
        mask = offs < D
        dy = tl.load(dout_ptr + t * stride_d + offs, mask=mask, other=0.0).to(tl.float32)
        if YS_GRAD:
            tl.store(gys_ptr + r * stride_g + offs, (dy * w).to(dt), mask=mask)
        if W_GRAD:
            y = tl.load(ys_ptr + r * stride_y + offs, mask=mask, other=0.0).to(tl.float32)
            s += (dy * y).to(dt).to(tl.float32)
    if W_GRAD:
        tl.store(gw_ptr + o, tl.sum(s, axis=0).to(dt))


def _check(what: str, rows: tuple[int, ...], dtype: torch.dtype, device: torch.device, index: Tensor,
           w: Tensor | None, k: int) -> None:
    """rows, dtype, device: those of the [T * k, D] rows; index: the permutation; w: the [T, k] weights, if any."""
    if len(rows) != 2 or dtype not in COMBINE_DTYPES:
        raise ValueError(f"{what}: rows must be 2-D bf16/fp16/fp32 [T * k, D], got {rows} {dtype}")
    if index.dtype != torch.int64 or index.dim() != 1 or index.numel() != rows[0]:
        raise ValueError(f"{what}: the permutation must be int64 [T * k] = [{rows[0]}], "
                         f"got {tuple(index.shape)} {index.dtype}")
    if k < 1 or rows[0] % k:
        raise ValueError(f"{what}: {rows[0]} rows do not split into slots of k = {k}")
    if w is not None and (w.dtype != dtype or tuple(w.shape) != (rows[0] // k, k)):
        raise ValueError(f"{what}: weights must be [T, k] = [{rows[0] // k}, {k}] in {dtype}, "
                         f"got {tuple(w.shape)} {w.dtype}")
    if any(t.device != device for t in (index, *(() if w is None else (w,)))):
        raise ValueError(f"{what}: rows, permutation and weights must be on one device")


def _rows(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _slot_sum(rows: Tensor, inverse: Tensor, w: Tensor | None, k: int) -> Tensor:
    t, d = rows.shape[0] // k, rows.shape[1]
    out = torch.empty((t, d), dtype=rows.dtype, device=rows.device)
    if out.numel():
        weighted = w is not None
        rows, inverse = _rows(rows), inverse.contiguous()
        w = _rows(w) if weighted else rows  # (unread without weights)
        pdl = use_pdl(out.device)
        _slot_sum_kernel[(t, triton.cdiv(d, _BLOCK))](
            rows, inverse, w, out, d, k, rows.stride(0), w.stride(0), out.stride(0), WEIGHTED=weighted,
            BLOCK=_BLOCK, PDL=pdl, launch_pdl=pdl, num_warps=4, enable_fp_fusion=False)  # fmt: skip
    return out


def moe_combine(ys: Tensor, inverse: Tensor, topk_w: Tensor) -> Tensor:
    """ys [T * k, D] expert rows sorted by expert, inverse int64 [T * k] (row of token t's slot j at t * k + j),
    topk_w [T, k] in ys' dtype -> [T, D]: each token's rows weighted and summed in slot order (see the module)."""
    _check("moe_combine", tuple(ys.shape), ys.dtype, ys.device, inverse, topk_w,
           topk_w.shape[-1] if topk_w.dim() == 2 else 0)
    return _slot_sum(ys, inverse, topk_w, topk_w.shape[1])


def slot_sum(rows: Tensor, inverse: Tensor, k: int) -> Tensor:
    """rows [T * k, D] sorted by expert, inverse as moe_combine's -> [T, D]: each token's k rows summed in fp32."""
    _check("slot_sum", tuple(rows.shape), rows.dtype, rows.device, inverse, None, k)
    return _slot_sum(rows, inverse, None, k)


def moe_combine_backward(dout: Tensor, order: Tensor, topk_w: Tensor, ys: Tensor | None = None,
                         ys_grad: bool = True) -> tuple[Tensor | None, Tensor | None]:
    """Gradients of moe_combine for dout [T, D]: (grad of ys [T * k, D] if ys_grad, grad of topk_w [T, k] if the
    rows `ys` are given: only that gradient reads them, so a caller whose weights need none need not keep them).
    order int64 [T * k] is the sort: sorted row r holds token order[r] // k's slot order[r] % k."""
    if dout.dim() != 2 or topk_w.dim() != 2:
        raise ValueError(f"moe_combine_backward: dout must be [T, D] and topk_w [T, k], got {tuple(dout.shape)} "
                         f"and {tuple(topk_w.shape)}")
    (t, d), k = dout.shape, topk_w.shape[1]
    _check("moe_combine_backward", (t * k, d), dout.dtype, dout.device, order, topk_w, k)
    if ys is not None and (ys.shape != (t * k, d) or ys.dtype != dout.dtype or ys.device != dout.device):
        raise ValueError(f"moe_combine_backward: ys must be [T * k, D] = [{t * k}, {d}] in {dout.dtype} like dout, "
                         f"got {tuple(ys.shape)} {ys.dtype}")
    w_grad = ys is not None
    gys = torch.empty((t * k, d), dtype=dout.dtype, device=dout.device) if ys_grad else None
    gw = torch.empty((t, k), dtype=dout.dtype, device=dout.device) if w_grad else None
    if t * k * d and (ys_grad or w_grad):
        dout, w = _rows(dout), _rows(topk_w)
        ys = _rows(ys) if w_grad else dout  # (unread without W_GRAD)
        # No PDL wait: a training backward, never in a decode graph.
        _combine_backward_kernel[(t * k,)](
            dout, ys, order.contiguous(), w, dout if gys is None else gys, w if gw is None else gw, d, k,
            dout.stride(0), ys.stride(0), w.stride(0), d, YS_GRAD=ys_grad, W_GRAD=w_grad, BLOCK=_BLOCK,
            num_warps=4, enable_fp_fusion=False)  # fmt: skip
    elif gw is not None:
        gw.zero_()
    return gys, gw
