"""The reward protocol and the name -> function registry.

A reward function scores one completion: ``fn(prompt, completion, metadata) -> float``. ``metadata`` is the
dataset row's extra fields (``metadata["answer"]`` for verifiable tasks). Register one with::

    @register_reward("my_reward")
    def my_reward(prompt: str, completion: str, metadata: dict) -> float: ...

and refer to it by name in ``RewardRunner`` specs or the ``reward/`` configs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..registry import Registry

RewardFn = Callable[[str, str, dict[str, Any]], float]

REWARDS: Registry[RewardFn] = Registry("reward")
register_reward = REWARDS.register  # decorator: @register_reward("name") def fn(prompt, completion, metadata)
get_reward = REWARDS.lookup


def reward_name(fn: RewardFn) -> str:
    """A readable name for an unregistered reward callable (used as its key in results)."""
    for registered, candidate in REWARDS.items():
        if candidate is fn:
            return registered
    return getattr(fn, "__name__", None) or type(fn).__name__
