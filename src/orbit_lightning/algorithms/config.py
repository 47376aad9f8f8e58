"""The RL algorithm's knobs: which registered estimator/loss to use and their hyper-parameters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AlgoConfig:
    advantage: str = "grpo"  # a name in ADVANTAGE_ESTIMATORS
    policy_loss: str = "ppo"  # a name in POLICY_LOSSES
    eps_low: float = 0.2
    eps_high: float | None = 0.28  # DAPO clip-higher; None = symmetric
    dual_clip: float | None = None
    loss_agg: str = "token_mean"  # token_mean | seq_mean_token_mean | seq_mean_token_sum_norm
    max_tokens: int | None = None  # Dr.GRPO's constant for seq_mean_token_sum_norm (default: max_new_tokens)
    kl_coef: float = 0.0  # beta; 0 skips the reference forward entirely
    kl_kind: str = "k3"
    kl_in_reward: bool = False  # True: KL as a reward penalty (k1) instead of a loss term
    entropy_coef: float = 0.0
    updates_per_step: int = 1  # K minibatch passes over each rollout batch
    minibatches: int = 1  # optimizer steps per pass
    micro_batch_tokens: int = 16384  # gradient accumulation by token budget within a minibatch
    grad_clip: float = 1.0
    importance: str | None = None  # None | "tis" | "mis": correct train/rollout mismatch (off by default)
    importance_level: str = "token"  # token | sequence | geometric
    importance_cap: float = 2.0
    dynamic_sampling: bool = False  # DAPO: drop all-equal-reward groups and refill
    max_sampling_rounds: int = 3

    @property
    def optimizer_steps_per_rl_step(self) -> int:
        """What one RL step adds to Lightning's global_step (it counts optimizer steps)."""
        return self.updates_per_step * self.minibatches

    def validate(self) -> None:
        from . import ADVANTAGE_ESTIMATORS, AGGREGATION_MODES, KL_KINDS, POLICY_LOSSES

        checks = [("advantage", self.advantage, ADVANTAGE_ESTIMATORS), ("policy_loss", self.policy_loss, POLICY_LOSSES),
                  ("loss_agg", self.loss_agg, AGGREGATION_MODES), ("kl_kind", self.kl_kind, KL_KINDS)]
        for key, value, choices in checks:
            if value not in choices:
                raise ValueError(f"algo.{key}={value!r} is not one of {sorted(choices)}")
        if self.importance not in (None, "tis", "mis"):
            raise ValueError(f"algo.importance={self.importance!r} must be null, 'tis' or 'mis'")
        if self.updates_per_step < 1 or self.minibatches < 1:
            raise ValueError("algo.updates_per_step and algo.minibatches must be >= 1")
        if not self.grad_clip > 0:
            raise ValueError(f"algo.grad_clip must be > 0 (a max gradient norm), got {self.grad_clip}; "
                             "use a large value such as 1e9 to effectively disable clipping")
