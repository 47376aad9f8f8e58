"""Sequence-level advantage estimators for group-sampled rollouts, behind a name -> function registry.

Every estimator has the signature::

    fn(rewards: Tensor,            # [N = B*G] float, group-contiguous (rows g*G..g*G+G-1 are one prompt)
       group_size: int,            # G
       valid: Tensor | None = None,  # [N] bool; False = failed/masked sample
       **options) -> Tensor        # [N] float32

Invalid samples get advantage 0 and are left out of every statistic. A group with fewer than two valid
samples has no baseline to compare against, so its samples get 0 too. Group statistics are computed in
float64: the mean of G identical float32 rewards is then exact, so an all-equal group gives exactly 0
rather than rounding noise divided by a tiny std.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..registry import Registry
from ._common import check_groups, float_mask, safe_denominator

AdvantageFn = Callable[..., Tensor]
ADVANTAGE_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator")
register_advantage = ADVANTAGE_ESTIMATORS.register  # decorator; estimators follow the module's common signature
get_advantage = ADVANTAGE_ESTIMATORS.lookup


@dataclass(frozen=True)
class _Groups:
    """Float64 group view of the rewards; ``centered`` is 0 at invalid samples."""

    valid: Tensor  # [B, G] bool
    count: Tensor  # [B, 1] float64, valid samples per group
    centered: Tensor  # [B, G] float64, r - group mean (0 where invalid)

    @classmethod
    def build(cls, rewards: Tensor, group_size: int, valid: Tensor | None, estimator: str) -> _Groups:
        r, v = check_groups(rewards, group_size, valid)
        if group_size < 2:
            raise ValueError(
                f"{estimator} needs group_size >= 2: its baseline compares samples of the same prompt, "
                f"so with group_size={group_size} every advantage would be 0"
            )
        r = torch.where(v, r.double(), torch.zeros((), dtype=torch.float64, device=r.device))
        count = v.sum(dim=1, keepdim=True).double()
        mean = r.sum(dim=1, keepdim=True) / count.clamp_min(1)
        return cls(valid=v, count=count, centered=torch.where(v, r - mean, torch.zeros_like(r)))

    def group_std(self) -> Tensor:
        """[B, 1] unbiased (Bessel) std over valid samples, as torch.std in TRL/veRL; 0 if < 2 valid."""
        var = self.centered.square().sum(dim=1, keepdim=True) / (self.count - 1).clamp_min(1)
        return var.sqrt()

    def finish(self, adv: Tensor) -> Tensor:
        """Zero invalid samples and groups without a baseline; flatten to [N] float32."""
        keep = self.valid & (self.count >= 2)
        return torch.where(keep, adv, torch.zeros_like(adv)).reshape(-1).float()


@register_advantage("grpo")
def grpo_advantages(
    rewards: Tensor,  # [N] float
    group_size: int,
    valid: Tensor | None = None,  # [N] bool
    *,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:  # [N] float32
    """GRPO (Shao et al. 2024, DeepSeekMath §4.1.2): A_i = (r_i - mean(r_group)) / (std(r_group) + eps).

    ``scale_by_std=False`` drops the division (then identical to ``dr_grpo``).
    """
    g = _Groups.build(rewards, group_size, valid, "grpo")
    # An all-equal group has std 0 and centred rewards exactly 0; the safe denominator keeps that 0
    # even with eps=0.
    adv = g.centered / safe_denominator(g.group_std() + eps) if scale_by_std else g.centered
    return g.finish(adv)


# GSPO (Zheng et al. 2025) keeps GRPO's group-normalised advantages; it changes the loss (losses.gspo_loss).
register_advantage("gspo")(grpo_advantages)


@register_advantage("dr_grpo")
def dr_grpo_advantages(
    rewards: Tensor,  # [N] float
    group_size: int,
    valid: Tensor | None = None,  # [N] bool
) -> Tensor:  # [N] float32
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): A_i = r_i - mean(r_group).

    No std division: it up-weights near-solved/near-failed questions (the paper's difficulty bias).
    """
    g = _Groups.build(rewards, group_size, valid, "dr_grpo")
    return g.finish(g.centered)


@register_advantage("rloo")
def rloo_advantages(
    rewards: Tensor,  # [N] float
    group_size: int,
    valid: Tensor | None = None,  # [N] bool
) -> Tensor:  # [N] float32
    """RLOO (Ahmadian et al. 2024): A_i = r_i - mean_{j != i} r_j over the group's valid samples.

    Algebraically r_i - (S - r_i)/(k - 1) = k/(k - 1) * (r_i - mean), with k valid samples.
    """
    g = _Groups.build(rewards, group_size, valid, "rloo")
    return g.finish(g.centered * g.count / (g.count - 1).clamp_min(1))


@register_advantage("reinforce_pp")
def reinforce_pp_advantages(
    rewards: Tensor,  # [N] float
    group_size: int,
    valid: Tensor | None = None,  # [N] bool
    *,
    eps: float = 1e-6,
) -> Tensor:  # [N] float32
    """REINFORCE++-baseline (Hu et al. 2025, arXiv:2501.03262): A = r - mean(r_group), then
    A / (std_batch(A) + eps) with the std over every valid sample of the batch.

    The paper also subtracts the batch mean of A first; after group centring that mean is 0 (up to
    rounding), so it is omitted. A KL penalty in the reward, if wanted, is applied beforehand
    (kl.kl_penalized_rewards).
    """
    g = _Groups.build(rewards, group_size, valid, "reinforce_pp")
    # centred rewards are already 0 outside usable groups; only the count must skip them
    n = (g.valid & (g.count >= 2)).sum().double()
    batch_std = (g.centered.square().sum() / (n - 1).clamp_min(1)).sqrt()
    return g.finish(g.centered / safe_denominator(batch_std + eps))


def sequence_to_token_advantages(
    advantages: Tensor,  # [N] float
    mask: Tensor,  # [N, T] bool/float, 1 = counted completion token
) -> Tensor:  # [N, T], advantages' dtype; 0 off the mask
    """Broadcast sequence-level advantages to every counted token of their sequence."""
    if advantages.dim() != 1 or mask.dim() != 2 or mask.shape[0] != advantages.shape[0]:
        raise ValueError(
            f"need advantages [N] and mask [N, T], got {tuple(advantages.shape)} and {tuple(mask.shape)}"
        )
    return advantages[:, None] * float_mask(mask, mask.shape, advantages.dtype)
