"""OFT (orthogonal fine-tuning) beside a frozen, possibly packed, base, with PEFT 0.21's maths and layout.

PEFT's `oft.Linear.forward` rotates the *input*: y = base(x · R) with R = blockdiag(R_1 .. R_r) [K, K],
each R_i [b, b] orthogonal (exactly, or up to a truncated series), made from a skew-symmetric Q_i by Cayley.
We do the same and never merge R into W, so a packed base stays packed and its dX-only backward is reused:
gradients reach only `oft_R`. The bias is not rotated (it sits after the matmul), as in PEFT.

Stored tensor (one per layer, PEFT key `{layer}.oft_R.weight`):
    oft_R  [r, b(b-1)/2]   the strict upper triangle of each Q_i, row-major (torch.triu_indices order);
                           r = K / b blocks, or 1 row shared by every block with `block_share`.
Zero init gives Q = 0, R = I: the adapter starts as the base.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .api import register_adapter
from .lora import base_device, base_dtype
from .slots import AdapterLayer, AdapterState
from .targets import is_experts


def skew_symmetric(vec: Tensor, triu: Tensor, block: int) -> Tensor:
    """vec: [r, b(b-1)/2] upper triangles, triu: [2, b(b-1)/2] int64 -> Q: [r, b, b] with Q = -Q^T."""
    q = vec.new_zeros(vec.shape[0], block, block)
    q[:, triu[0], triu[1]] = vec
    return q - q.transpose(-2, -1)


def cayley(q: Tensor, neumann_terms: int | None) -> Tensor:
    """q: [r, b, b] skew-symmetric -> rotations [r, b, b], in q's dtype.

    Exact (neumann_terms=None): R = (I - Q)(I + Q)^-1, orthogonal to working precision.
    Neumann: PEFT 0.21's truncated series of (I + Q)(I - Q)^-1 = I + 2Q + 2Q^2 + ..., whose last kept power
    Q^(n-1) has weight 1 (not 2); with 3 and 4 terms PEFT keeps the same powers, and so do we. Note the two
    branches parametrize transposed rotations for the same Q; matching PEFT means keeping that quirk.
    """
    eye = torch.eye(q.shape[-1], dtype=q.dtype, device=q.device).expand_as(q)
    if neumann_terms is None:
        return torch.linalg.solve(eye + q, eye - q, left=False)
    r = eye.clone()
    if neumann_terms > 1:
        r = r + 2.0 * q
    if neumann_terms > 2:
        power = q @ q
        r = r + 2.0 * power
        for _ in range(3, neumann_terms - 1):
            power = power @ q
            r = r + 2.0 * power
        r = r + power @ q
    return r


def coft_project(vec: Tensor, eps: float) -> Tensor:
    """Constrained OFT: clip each block's ||Q_i||_F to eps / sqrt(rows). vec: [rows, b(b-1)/2] -> same.

    ||Q_i||_F = sqrt(2) ||vec_i|| because every upper entry appears twice (once negated) in Q_i."""
    limit = eps / vec.shape[0] ** 0.5
    norm = 2.0**0.5 * vec.norm(dim=-1, keepdim=True)
    return torch.where(norm <= limit, vec, vec * (limit / norm))


def rotate_input(x: Tensor, rot: Tensor) -> Tensor:
    """x: [..., K], rot: [r, b, b] with r*b = K -> x · blockdiag(rot): [..., K]."""
    r, b, _ = rot.shape
    return torch.einsum("...rk,rkc->...rc", x.unflatten(-1, (r, b)), rot).flatten(-2)


class OftLinear(AdapterLayer):
    PARAMS = ("oft_R",)

    def __init__(self, base_layer: nn.Module, state: AdapterState, block_size: int, block_share: bool = False,
                 neumann_terms: int | None = 5, coft: bool = False, eps: float = 6e-5,
                 init_identity: bool = True, dtype: torch.dtype | None = None):
        super().__init__(base_layer, state)
        k = base_layer.in_features
        dtype, device = dtype or base_dtype(base_layer), base_device(base_layer)
        self.block_size, self.num_blocks = block_size, k // block_size
        self.block_share, self.neumann_terms, self.coft, self.eps = block_share, neumann_terms, coft, eps
        rows = 1 if block_share else self.num_blocks
        n = block_size * (block_size - 1) // 2
        self.oft_R = nn.Parameter(torch.zeros(rows, n, dtype=dtype, device=device))
        if not init_identity:
            nn.init.normal_(self.oft_R, mean=0.0, std=0.1)  # PEFT's init_weights=False
        triu = torch.triu_indices(block_size, block_size, 1, device=device)  # [2, n]: PEFT's element order
        self.register_buffer("triu", triu, persistent=False)
        self.in_features, self.out_features = k, base_layer.out_features

    def rotation(self, vec: Tensor) -> Tensor:
        """vec: [rows, b(b-1)/2] -> [num_blocks, b, b] in vec's dtype."""
        # The b x b series/solve runs in fp32 (fp64 for fp64 adapters) whatever the adapter dtype: it costs
        # nothing next to the matmuls and keeps a bf16 adapter's R orthogonal to bf16 rounding, not worse.
        work = torch.float64 if vec.dtype == torch.float64 else torch.float32
        q = skew_symmetric(vec.to(work), self.triu, self.block_size)
        rot = cayley(q, self.neumann_terms).to(vec.dtype)
        return rot.expand(self.num_blocks, -1, -1) if self.block_share else rot

    def forward(self, x: Tensor) -> Tensor:
        t = self.active_tensors()
        if t is None:
            return self.base_layer(x)
        vec = t["oft_R"]
        if self.coft:  # PEFT projects the stored tensor in place, so later steps start from the projection
            with torch.no_grad():
                vec.copy_(coft_project(vec, self.eps))
        x_rot = rotate_input(x.to(vec.dtype), self.rotation(vec))
        return self.base_layer(x_rot.to(x.dtype))


def oft_block_size(name: str, in_features: int, r: int, block_size: int) -> int:
    """PEFT sets exactly one of `r` (blocks per layer) and `oft_block_size`; the other is K divided by it.

    PEFT silently rounds a non-dividing value to a nearby divisor; we refuse instead, so that the trained
    adapter's shape is the one the user asked for."""
    given, what = (block_size, "oft_block_size") if block_size else (r, "r")
    if given <= 0 or in_features % given:
        divisors = [d for d in range(1, in_features + 1) if in_features % d == 0]
        raise ValueError(f"OFT {what}={given} does not divide in_features={in_features} of {name!r}; "
                         f"pick a divisor of every targeted layer's in_features (here: {divisors})")
    return block_size if block_size else in_features // r


def _check_config(cfg) -> None:
    if cfg.module_dropout != 0:
        raise ValueError(f"OFT module_dropout={cfg.module_dropout} is not supported: it would make the old, "
                         "reference and new log-probs of one batch disagree; set module_dropout=0")
    if cfg.bias != "none":
        raise ValueError(f"OFT bias={cfg.bias!r} is not supported (it trains base biases, so disable_adapter "
                         "would no longer give the base); use bias='none'")
    if cfg.layers_to_transform is not None or cfg.modules_to_save:
        raise ValueError("OFT layers_to_transform / modules_to_save are not supported; select layers with a "
                         "regex target_modules instead")
    if cfg.init_weights not in (True, False):
        raise ValueError(f"OFT init_weights must be True (identity) or False (random), "
                         f"got {cfg.init_weights!r}")


@register_adapter("OFT")
def build_oft(name: str, module: nn.Module, state: AdapterState, cfg) -> OftLinear:
    if is_experts(module):
        raise ValueError(f"OFT on routed experts ({name!r}) is not supported (PEFT 0.21 cannot load it "
                         "either); target attention and dense MLP projections, or add "
                         "exclude_modules=['experts']")
    _check_config(cfg)
    block = oft_block_size(name, module.in_features, cfg.r, cfg.oft_block_size)
    return OftLinear(module, state, block, block_share=cfg.block_share,
                     neumann_terms=cfg.num_cayley_neumann_terms if cfg.use_cayley_neumann else None,
                     coft=cfg.coft, eps=cfg.eps, init_identity=cfg.init_weights)
