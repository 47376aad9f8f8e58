"""RL maths as pure functions: tensors in, tensors out (no Lightning, no models).

A rollout batch is B prompts x G samples flattened to N = B*G group-contiguous rows; token tensors are
[N, T] with a 0/1 ``mask`` marking the completion tokens that count.
"""

from .advantages import (
    ADVANTAGE_ESTIMATORS,
    dr_grpo_advantages,
    get_advantage,
    grpo_advantages,
    register_advantage,
    reinforce_pp_advantages,
    rloo_advantages,
    sequence_to_token_advantages,
)
from .dynamic_sampling import concat_kept_groups, group_keep_mask
from .importance import IS_LEVELS, IS_METHODS, importance_weights
from .kl import KL_KINDS, entropy_from_logits, entropy_from_logits_chunked, kl_estimate, kl_penalized_rewards
from .losses import (
    AGGREGATION_MODES,
    POLICY_LOSSES,
    aggregate_loss,
    get_policy_loss,
    gspo_loss,
    ppo_loss,
    register_policy_loss,
)
from .passk import pass_at_k

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATION_MODES",
    "IS_LEVELS",
    "IS_METHODS",
    "KL_KINDS",
    "POLICY_LOSSES",
    "aggregate_loss",
    "concat_kept_groups",
    "dr_grpo_advantages",
    "entropy_from_logits",
    "entropy_from_logits_chunked",
    "get_advantage",
    "get_policy_loss",
    "group_keep_mask",
    "grpo_advantages",
    "gspo_loss",
    "importance_weights",
    "kl_estimate",
    "kl_penalized_rewards",
    "pass_at_k",
    "ppo_loss",
    "register_advantage",
    "register_policy_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "sequence_to_token_advantages",
]
