"""Building blocks shared by every decoder: RMSNorm, rotary embeddings, the gated MLP.

RoPE and SwiGLU's `silu(gate) * up` are chains of small elementwise torch ops (about 7 launches per tensor for
RoPE, 2 for SwiGLU), which dominate decode at batch 1. Where no autograd graph is needed they run as one Triton
launch each (`kernels.rope`, `kernels.silu_mul`), which reproduces torch's rounding steps bit for bit, so the
torch path (training) and the fused one (rollout, no_grad scoring) agree exactly, in either mode.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..quant.fusion import project
from ..triton_kernels import kernels_module
from . import invariant
from .config import RopeConfig


def _fused(x: Tensor, *others: Tensor, cuda_only: bool = False) -> bool:
    """Whether an elementwise chain on `x` takes its one-launch kernel: never under autograd (the kernels have no
    backward); else where RMSNorm takes its kernel: on CUDA, and in batch-invariant mode wherever the kernels run.
    On the CPU that is Triton's interpreter: slow, and bitwise equal to torch only in fp32/fp16 (its bf16 casts
    truncate), and not at all for `cuda_only` kernels."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, *others)):
        return False
    if not invariant.kernels_take(x):
        return False
    if x.is_cuda:
        return x.dtype in (torch.bfloat16, torch.float16, torch.float32)
    return not cuda_only and x.dtype in (torch.float16, torch.float32)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return invariant.rms_norm(x, self.weight, self.eps, self.reference)

    def add_forward(self, x: Tensor, h: Tensor | None) -> tuple[Tensor, Tensor]:
        """(x + h, self(x + h)), the residual add and this norm in one launch where the kernel serves; h None: (x,
        self(x))."""
        if h is None:
            return x, self(x)
        return invariant.add_rms_norm(x, h, self.weight, self.eps, self.reference)

    def reference(self, x: Tensor, weight: Tensor) -> Tensor:
        # Normalise in fp32 (bf16 mean-of-squares loses ~3 digits), cast back before the weight as HF does.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * x.to(dtype)


def _yarn_inv_freq(dim: int, rc: RopeConfig) -> tuple[Tensor, float]:
    """YaRN (arXiv:2309.00071): interpolate low frequencies, keep high ones, blend with a linear ramp."""

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, base = rc.factor, rc.theta
    attn = rc.attention_factor
    if attn is None:
        attn = (mscale(factor, rc.mscale) / mscale(factor, rc.mscale_all_dim)
                if rc.mscale and rc.mscale_all_dim else mscale(factor))

    def correction_dim(rotations: float) -> float:
        return dim * math.log(rc.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rc.beta_fast), correction_dim(rc.beta_slow)
    if rc.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolate = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attn)


class Rotary(nn.Module):
    """Produces cos/sin [B, T, dim] in fp32 for integer positions [B, T]."""

    def __init__(self, dim: int, rc: RopeConfig):
        super().__init__()
        if rc.type == "yarn":
            inv_freq, self.attention_factor = _yarn_inv_freq(dim, rc)
        else:
            inv_freq = 1.0 / (rc.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
            self.attention_factor = 1.0
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.interleave = rc.interleave

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq.float()  # [B, T, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, interleave: bool = False) -> Tensor:
    """x [B, H, T, d]; cos/sin [B, T, d] (fp32). Returns x.dtype."""
    if _fused(x, cos, sin):
        return kernels_module().rope(x, None, cos, sin, interleave)[0]
    return rope_reference(x, cos, sin, interleave)


def apply_rope_qk(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleave: bool = False) -> tuple[Tensor, Tensor]:
    """`apply_rope` of q and k, in one launch where the kernel applies."""
    if _fused(q, k, cos, sin):
        return kernels_module().rope(q, k, cos, sin, interleave)
    return rope_reference(q, cos, sin, interleave), rope_reference(k, cos, sin, interleave)


def norm_rope_qk(q: Tensor, k: Tensor, q_norm: RMSNorm, k_norm: RMSNorm, cos: Tensor, sin: Tensor
                 ) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Qwen3's per-head q/k RMSNorm then RoPE: q [B, T, H, d], k [B, T, Hkv, d] -> [B, H, T, d] each. Without
    autograd and outside batch-invariant mode, one launch (`kernels.rope` with the norm weights); its sum of squares
    may round apart from the norm kernel's, so the mode keeps the two steps, bitwise those the trainer runs."""
    if (_fused(q, k, cos, sin) and not invariant.active() and q_norm.eps == k_norm.eps
            and q_norm.weight.dtype == k_norm.weight.dtype == q.dtype):  # fmt: skip
        weights = (q_norm.weight, k_norm.weight)
        return kernels_module().rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin, norm_weights=weights,
                                     eps=q_norm.eps)  # fmt: skip
    return apply_rope_qk(q_norm(q).transpose(1, 2), k_norm(k).transpose(1, 2), cos, sin)


def rope_reference(x: Tensor, cos: Tensor, sin: Tensor, interleave: bool = False) -> Tensor:
    """`apply_rope` by torch ops (differentiable). kernels/rope.py replays their roundings one by one: keep the
    two in step."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    if interleave:
        # Pairs (x0, x1), (x2, x3), ... share a frequency; the output lists evens then odds, which permutes
        # q and k identically and so leaves every q·k unchanged (and matches transformers' layout).
        half = cos.shape[-1] // 2
        cos, sin = cos[..., :half], sin[..., :half]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    FUSED_INPUTS = (("gate_proj", "up_proj"),)  # read x together at decode (quant.fusion)

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = project(x, (self.gate_proj, self.up_proj))
        return self.down_proj(silu_mul(gate, up))


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """`F.silu(gate) * up`, in one launch on CUDA where no autograd graph is needed. Not under the CPU interpreter:
    its exp is numpy's, which differs from torch's CPU exp in the last bit."""
    if gate.shape == up.shape and gate.dtype == up.dtype and _fused(gate, up, cuda_only=True):
        return kernels_module().silu_mul(gate, up)
    return F.silu(gate) * up
