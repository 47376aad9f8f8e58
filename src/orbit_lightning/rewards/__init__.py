"""Rewards: the reward protocol and registry, the concurrent runner, math verifiers and the code sandbox.

Importing this package registers the built-in rewards: ``math_exact``, ``format``, ``arithmetic_exact`` and
``code_tests``.
"""

from orbit_lightning.rewards.base import REWARDS, RewardFn, get_reward, register_reward
from orbit_lightning.rewards.math import (
    answers_match,
    arithmetic_exact_reward,
    extract_answer,
    format_reward,
    math_exact_reward,
    normalize_answer,
    parse_number,
)
from orbit_lightning.rewards.runner import RewardResult, RewardRunner
from orbit_lightning.rewards.sandbox import SandboxResult, code_tests_reward, extract_code, run_python

__all__ = [
    "REWARDS",
    "RewardFn",
    "RewardResult",
    "RewardRunner",
    "SandboxResult",
    "answers_match",
    "arithmetic_exact_reward",
    "code_tests_reward",
    "extract_answer",
    "extract_code",
    "format_reward",
    "get_reward",
    "math_exact_reward",
    "normalize_answer",
    "parse_number",
    "register_reward",
    "run_python",
]
