"""Mixture-of-experts: routers (softmax top-k; DeepSeek's grouped sigmoid) and routed experts.

Routed experts are stacked [E, N, K] per projection; (token, slot) pairs are sorted by the expert they were
routed to. `dispatch_experts` is the single MoE path, with two ways to split the rows (see quant.grouped):
- device groups: one grouped call per projection over all experts, on device offsets [E+1]; no host sync, so
  decode can be captured in a CUDA graph. Taken whenever the experts' `linear` can (`chunk_size` is None).
- chunk groups: the host reads the group sizes (one sync, one upload of every chunk's offsets) and runs a chunk of
  active experts per grouped call, which bounds the transient weights of paths that materialize them (dequantized
  packed experts on large batches): one projection of a chunk fits `chunk_mib` MiB, unless `chunk` sets a count.
  Chunks are as large as that allows: each costs 100-200 us of host time per projection (bench/moe_paths.py:
  chunks of 4 Qwen3-30B-A3B experts ran 5-20x slower than one).
The combine is deterministic on both. Subclasses (quantized experts, expert LoRA) change only `linear` and the
choice of path.
"""

from __future__ import annotations

from functools import partial
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..quant.grouped import ExpertGroups, grouped_mm, torch_grouped_mm_blocker
from ..triton_kernels import kernels_module, kernels_run_on
from . import invariant
from .config import ModelConfig
from .layers import MLP, silu_mul

DEFAULT_CHUNK_MIB = 1024  # transient dequantized expert weights per chunked grouped call
# The routing's kernels on CUDA (set False to compare against torch's ops, as bench/'s --torch-* flags do).
KERNEL_COMBINE = True  # kernels.moe_combine and its backward, and the dispatch's backward (kernels.slot_sum)
KERNEL_SORT = True  # kernels.sort_by_expert
KERNEL_ROUTE = True  # kernels.softmax_topk (Qwen3-MoE's softmax top-k after the router GEMM)


class SoftmaxRouter(nn.Module):
    """Qwen3-MoE: softmax over all experts in fp32, top-k, optional renormalisation."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        logits = F.linear(x, self.weight)
        if _kernel_route(logits, self.top_k):  # one launch where torch takes ~6 (decode: ~14 us per layer)
            w, idx = kernels_module().softmax_topk(logits.detach(), self.top_k, self.norm_topk_prob, x.dtype)
            weights = partial(_topk_weights, renormalize=self.norm_topk_prob, dtype=x.dtype)
            return invariant.with_reference_grad(lambda *_: w, weights, logits, idx), idx
        w, idx = logits.softmax(dim=-1, dtype=torch.float32).topk(self.top_k, dim=-1)
        return _renormalized(w, self.norm_topk_prob, x.dtype), idx


def _topk_weights(logits: Tensor, idx: Tensor, renormalize: bool, dtype: torch.dtype) -> Tensor:
    """The routing weights of the chosen experts `idx` [T, k]: their fp32 softmax probabilities over all experts,
    divided by their sum if `renormalize`, in `dtype` (what the router's torch path computes)."""
    return _renormalized(logits.softmax(dim=-1, dtype=torch.float32).gather(1, idx), renormalize, dtype)


def _renormalized(w: Tensor, renormalize: bool, dtype: torch.dtype) -> Tensor:
    return (w / invariant.sum_last(w, keepdim=True) if renormalize else w).to(dtype)


def _kernel_route(logits: Tensor, k: int) -> bool:
    """Whether softmax top-k takes kernels.softmax_topk: on CUDA where the kernels run, for a power-of-two k (its
    slot range). Every batch size: engine and trainer then route alike."""
    return (KERNEL_ROUTE and logits.is_cuda and k & (k - 1) == 0 and k <= logits.shape[-1]
            and kernels_run_on(logits.device))  # fmt: skip


class GroupedSigmoidRouter(nn.Module):
    """DeepSeek-V3: sigmoid scores, bias-corrected choice within the best `topk_group` of `n_group` groups."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e = cfg.num_experts
        self.weight = nn.Parameter(torch.empty(e, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(e))
        self.top_k, self.n_group, self.topk_group = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias.float()  # the bias steers selection, not the weights
        t, e = choice.shape
        grouped = choice.view(t, self.n_group, e // self.n_group)
        group_scores = invariant.sum_last(grouped.topk(min(2, e // self.n_group), dim=-1).values)  # [T, n_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep[:, :, None].expand_as(grouped).reshape(t, e), float("-inf"))
        idx = choice.topk(self.top_k, dim=-1).indices
        w = scores.gather(1, idx)
        if self.norm_topk_prob:
            w = w / (invariant.sum_last(w, keepdim=True) + 1e-20)
        return (w * self.scaling).to(x.dtype), idx


class Experts(nn.Module):
    """Stacked routed experts: gate_proj/up_proj [E, I, D], down_proj [E, D, I]."""

    PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
    chunk, chunk_mib = 0, DEFAULT_CHUNK_MIB  # experts per chunk: `chunk` if > 0, else what `chunk_mib` holds

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.gate_proj = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    @property
    def transient_dtype(self) -> torch.dtype:
        """The dtype of the weights a chunk materializes."""
        return self.gate_proj.dtype

    def projection_bytes(self) -> int:
        """Bytes of one expert's [intermediate, hidden] projection in the transient dtype (what a chunk materializes
        per expert)."""
        return self.hidden * self.intermediate * self.transient_dtype.itemsize

    def experts_per_chunk(self) -> int:
        """`chunk`, or as many experts as one projection of `chunk_mib` MiB holds (at least one)."""
        if self.chunk > 0:
            return self.chunk
        return max(1, (self.chunk_mib << 20) // self.projection_bytes())

    def linear(self, proj: str, x: Tensor, groups: ExpertGroups) -> Tensor:
        """x [M, K] rows sorted by expert, split as `groups` says -> [M, N]."""
        return grouped_mm(x, groups.select(getattr(self, proj)), groups)

    def swiglu(self, x: Tensor, groups: ExpertGroups) -> Tensor:
        """The expert MLP's first half, silu(x W_gate^T) * (x W_up^T), for rows sorted by expert."""
        return silu_mul(self.linear("gate_proj", x, groups), self.linear("up_proj", x, groups))

    def device_groups_blocker(self, device: torch.device, invariant: bool = False) -> str | None:
        """Why `linear` cannot take device groups on `device` (None: it can); `invariant`: and stay batch-invariant
        without reading group sizes on the host (what a CUDA graph of batch-invariant decode needs)."""
        if invariant:  # the kernels' plain grouped GEMM takes device offsets
            return None if kernels_run_on(device) else f"the Triton kernels cannot run on {device}"
        return torch_grouped_mm_blocker(self.gate_proj.dtype, tuple(self.gate_proj.shape[1:]), device)

    def chunk_size(self, rows: int, device: torch.device) -> int | None:
        """None: device groups for `rows` routed rows; else experts per chunk. Plain weights are never
        materialized, so device groups whenever torch's grouped GEMM takes them."""
        return None if self.device_groups_blocker(device) is None else self.experts_per_chunk()

    def forward(self, x: Tensor, topk_ids: Tensor, topk_w: Tensor) -> Tensor:
        return dispatch_experts(x, topk_ids, topk_w, self)


class GroupedExperts(Protocol):
    """What `dispatch_experts` needs: `Experts`, its subclasses and `LoraExperts` provide it."""

    num_experts: int

    def chunk_size(self, rows: int, device: torch.device) -> int | None: ...

    def linear(self, proj: str, x: Tensor, groups: ExpertGroups) -> Tensor: ...

    def swiglu(self, x: Tensor, groups: ExpertGroups) -> Tensor: ...


def dispatch_experts(x: Tensor, topk_ids: Tensor, topk_w: Tensor, experts: GroupedExperts) -> Tensor:
    """x [T, D], topk_ids [T, k] int64, topk_w [T, k] -> [T, D]: route (token, slot) pairs to experts, run the
    expert MLP on device groups or chunk by chunk (`experts.chunk_size`), combine in a fixed order."""
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    if _kernel_sort(flat, experts.num_experts):  # the same three tensors in one launch (decode sizes)
        order, inverse, offsets = kernels_module().sort_by_expert(flat, experts.num_experts)
    else:
        order = flat.argsort(stable=True)  # (token, slot) pairs sorted by expert
        inverse = _inverse_permutation(order)
        offsets = _expert_offsets(flat[order], num_experts=experts.num_experts)
    xs = _gather_tokens(x, order, inverse, k)
    chunk = experts.chunk_size(flat.numel(), x.device)
    if chunk is None:
        ys = _expert_mlp(experts, xs, ExpertGroups(offsets))
    else:
        ys = _chunked_mlp(experts, xs, offsets, max(1, chunk))
    return _combine(ys, order, topk_w, x.dtype, inverse)


def _inverse_permutation(perm: Tensor) -> Tensor:
    """inverse[perm[i]] = i, by one scatter (not a second sort)."""
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))


class _GatherRows(torch.autograd.Function):
    """src[perm] for a permutation `perm` of src's rows, whose gradient is grad[inverse]: a gather, where
    autograd's generic index backward scatters into zeros with accumulation."""

    @staticmethod
    def forward(ctx, src: Tensor, perm: Tensor, inverse: Tensor) -> Tensor:
        ctx.save_for_backward(inverse)
        return src.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


class _GatherTokens(torch.autograd.Function):
    """x[order // k]: each token's row once per routed slot, in expert order. The gradient is a gather by `inverse`
    and then a sum of each token's k slots in slot order (what expanding x k times and gathering gave, without
    writing the expanded copy): deterministic, and no accumulating scatter (index_put, ~8 ms per call on the CPU)."""

    @staticmethod
    def forward(ctx, x: Tensor, order: Tensor, inverse: Tensor, k: int) -> Tensor:
        ctx.save_for_backward(inverse)
        ctx.k = k
        return x.index_select(0, order // k)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (inverse,) = ctx.saved_tensors
        if _kernel_combine(grad):  # the same sum without writing the gathered [T * k, D] copy
            return kernels_module().slot_sum(grad, inverse, ctx.k), None, None, None
        per_slot = grad.index_select(0, inverse)  # [T * k, D] in (token, slot) order
        return per_slot.view(-1, ctx.k, grad.shape[-1]).sum(1), None, None, None


def _gather_tokens(x: Tensor, order: Tensor, inverse: Tensor, k: int) -> Tensor:
    if torch.is_grad_enabled() and x.requires_grad:
        return _GatherTokens.apply(x, order, inverse, k)
    return x.index_select(0, order // k)


def _expert_offsets(sorted_ids: Tensor, num_experts: int) -> Tensor:
    """int32 [E+1] row offsets of every expert (empty ones included) from the sorted expert ids; no host sync."""
    experts = torch.arange(num_experts, device=sorted_ids.device, dtype=sorted_ids.dtype)
    ends = torch.searchsorted(sorted_ids, experts, right=True, out_int32=True)
    return torch.cat([ends.new_zeros(1), ends])


def _expert_mlp(experts: GroupedExperts, rows: Tensor, groups: ExpertGroups) -> Tensor:
    return experts.linear("down_proj", experts.swiglu(rows, groups), groups)


def _chunked_mlp(experts: GroupedExperts, xs: Tensor, offsets: Tensor, chunk: int) -> Tensor:
    """Active experts `chunk` at a time, on group sizes read by the host (the sync the device groups avoid)."""
    plan = ExpertGroups.chunks(offsets.diff().tolist(), chunk, xs.device)
    if not plan:
        return xs.new_zeros(0, xs.shape[-1])
    if len(plan) == 1:
        return _expert_mlp(experts, xs, plan[0][2])
    # One split, not a slice per chunk: each slice's backward would zero-fill a full-size gradient.
    pieces = xs.split([end - start for start, end, _ in plan])
    return torch.cat([_expert_mlp(experts, rows, groups) for rows, (_, _, groups) in zip(pieces, plan, strict=True)])


def _combine(ys: Tensor, order: Tensor, topk_w: Tensor, dtype: torch.dtype, inverse: Tensor | None = None) -> Tensor:
    """Expert outputs sorted by expert -> [T, D]: back in (token, slot) order, weighted, and the k slots summed
    in slot order, so a token's result depends neither on the rest of the batch nor on atomics. `inverse`: the
    inverse of `order`, if already at hand."""
    t, k = topk_w.shape
    inverse = _inverse_permutation(order) if inverse is None else inverse
    if ys.dtype == topk_w.dtype == dtype and _kernel_combine(ys):
        if torch.is_grad_enabled() and (ys.requires_grad or topk_w.requires_grad):
            return _KernelCombine.apply(ys, topk_w, order, inverse)
        return kernels_module().moe_combine(ys, inverse, topk_w)
    if torch.is_grad_enabled() and ys.requires_grad:
        # Gathered slot-major ([k, T, D]) and unbound, not y[:, j] of [T, k, D]: each slot's rows are contiguous
        # (vector kernels), and the backward stacks the k slot gradients once, where k selects zero-filled and
        # accumulated k full [T, k, D] gradients (2.2 ms of a Qwen3-30B-A3B expert MLP's 7 ms at 8k tokens, H200).
        slot_major = inverse.view(t, k).t().reshape(-1)  # row j * T + i: the sorted position of (token i, slot j)
        y = _GatherRows.apply(ys, slot_major, (order % k) * t + order // k).view(k, t, ys.shape[-1]).unbind(0)
    else:  # (decode: no index arithmetic to launch; the same values)
        y = ys.index_select(0, inverse).view(t, k, ys.shape[-1]).unbind(1)
    w = topk_w.unbind(1)
    out = (y[0] * w[0][:, None]).to(dtype)
    for j in range(1, k):
        out = out + (y[j] * w[j][:, None]).to(dtype)
    return out


def _kernel_sort(expert_ids: Tensor, num_experts: int) -> bool:
    """Whether the routing sort takes kernels.sort_by_expert: on CUDA where the kernels run, for the batches it
    sorts in one program (decode; larger ones keep torch's sort, whose launches they amortize)."""
    return (KERNEL_SORT and expert_ids.is_cuda and kernels_run_on(expert_ids.device)
            and kernels_module().moe_sort.sorts(expert_ids.numel(), num_experts))


def _kernel_combine(rows: Tensor) -> bool:
    """Whether the combine (and the dispatch's backward) take their one-launch kernels (kernels.moe_combine): on
    CUDA where the kernels run. Bitwise torch's steps there, so the engine and the trainer agree whichever path
    each takes; the CPU keeps torch's ops (the interpreter's bf16 casts truncate)."""
    return (KERNEL_COMBINE and rows.is_cuda and kernels_run_on(rows.device)
            and rows.dtype in kernels_module().COMBINE_DTYPES)


class _KernelCombine(torch.autograd.Function):
    """kernels.moe_combine with its backward kernel: ys is read in place, where torch's ops keep k gathered slot
    copies for the weights' gradient and launch a gather and 2k - 1 broadcast kernels each way."""

    @staticmethod
    def forward(ctx, ys: Tensor, topk_w: Tensor, order: Tensor, inverse: Tensor) -> Tensor:
        # ys only for the weights' gradient: a frozen router (LoRA-only RL) keeps no [T * k, D] copy alive
        ctx.save_for_backward(ys if ctx.needs_input_grad[1] else None, topk_w, order)
        return kernels_module().moe_combine(ys, inverse, topk_w)

    @staticmethod
    def backward(ctx, dout: Tensor):
        ys, topk_w, order = ctx.saved_tensors
        return (*kernels_module().moe_combine_backward(dout, order, topk_w, ys, ctx.needs_input_grad[0]), None, None)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = GroupedSigmoidRouter(cfg) if cfg.router == "sigmoid_grouped" else SoftmaxRouter(cfg)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts) if cfg.n_shared_experts else None
        )

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        w, idx = self.gate(flat)
        out = self.experts(flat, idx, w).view(shape)
        return out + self.shared_experts(x) if self.shared_experts is not None else out
