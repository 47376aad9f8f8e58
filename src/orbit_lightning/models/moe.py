"""Mixture-of-experts: routers (softmax top-k; DeepSeek's grouped sigmoid) and active-expert-chunked experts.

Routed experts are stacked [E, N, K] per projection. Tokens are grouped by the expert they were routed to and
only *active* experts are touched, `chunk` experts at a time; each chunk runs as one grouped GEMM. Subclasses
(quantized experts, expert LoRA) change only `linear`, so the dispatch loop below is the single MoE path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..quant.grouped import grouped_mm
from .config import ModelConfig
from .layers import MLP

DEFAULT_EXPERT_CHUNK = 4


class SoftmaxRouter(nn.Module):
    """Qwen3-MoE: softmax over all experts in fp32, top-k, optional renormalisation."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        probs = F.linear(x, self.weight).softmax(dim=-1, dtype=torch.float32)
        w, idx = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        return w.to(x.dtype), idx


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
        group_scores = grouped.topk(min(2, e // self.n_group), dim=-1).values.sum(-1)  # [T, n_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep[:, :, None].expand_as(grouped).reshape(t, e), float("-inf"))
        idx = choice.topk(self.top_k, dim=-1).indices
        w = scores.gather(1, idx)
        if self.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return (w * self.scaling).to(x.dtype), idx


class Experts(nn.Module):
    """Stacked routed experts: gate_proj/up_proj [E, I, D], down_proj [E, D, I]."""

    PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_proj = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.chunk = DEFAULT_EXPERT_CHUNK

    def linear(self, proj: str, x: Tensor, expert_ids: Tensor, group_sizes: list[int]) -> Tensor:
        """x [M, K] grouped by expert (group_sizes over expert_ids [c]) -> [M, N]."""
        return grouped_mm(x, getattr(self, proj)[expert_ids], group_sizes)

    def chunk_size(self, rows: int, num_active: int, device: torch.device) -> int:
        """Experts per grouped GEMM: `chunk` bounds the transient BF16 weights; paths that never materialize
        weights (fused kernels) take every active expert at once."""
        return self.chunk

    def forward(self, x: Tensor, topk_ids: Tensor, topk_w: Tensor) -> Tensor:
        return dispatch_experts(x, topk_ids, topk_w, self.num_experts, self.chunk_size, self.linear)


def dispatch_experts(
    x: Tensor,  # [T, D]
    topk_ids: Tensor,  # [T, k] int64
    topk_w: Tensor,  # [T, k]
    num_experts: int,
    chunk_size: Callable[[int, int, torch.device], int],  # (rows, active experts, device) -> experts per GEMM
    linear: Callable[[str, Tensor, Tensor, list[int]], Tensor],  # (proj, rows, expert_ids, group_sizes) -> out
) -> Tensor:
    """Route (token, slot) pairs to experts, run active experts `chunk` at a time, combine -> [T, D]."""
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = flat.argsort(stable=True)
    token = order // k  # source token of each sorted (token, slot) pair
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    active = [e for e, c in enumerate(counts) if c]
    xs = x[token]
    outs, start = [], 0
    chunk = max(1, chunk_size(len(flat), len(active), x.device))
    for i in range(0, len(active), chunk):
        ids = active[i : i + chunk]
        sizes = [counts[e] for e in ids]
        rows = xs[start : start + sum(sizes)]
        start += sum(sizes)
        eid = torch.tensor(ids, device=x.device)
        h = F.silu(linear("gate_proj", rows, eid, sizes)) * linear("up_proj", rows, eid, sizes)
        outs.append(linear("down_proj", h, eid, sizes))
    y = torch.cat(outs) * topk_w.reshape(-1)[order, None]
    return x.new_zeros(t, x.shape[-1]).index_add_(0, token, y.to(x.dtype))


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
