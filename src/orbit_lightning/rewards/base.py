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

RewardFn = Callable[[str, str, dict[str, Any]], float]

REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str, *, overwrite: bool = False) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering ``fn`` under ``name``; returns ``fn`` unchanged.

    Re-registering a taken name is an error unless ``overwrite=True``, so two plugins cannot silently
    shadow each other.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"reward name must be a non-empty string, got {name!r}")

    def decorator(fn: RewardFn) -> RewardFn:
        if not callable(fn):
            raise TypeError(f"register_reward({name!r}) needs a callable, got {type(fn).__name__}")
        if name in REWARDS and REWARDS[name] is not fn and not overwrite:
            raise ValueError(
                f"a reward named {name!r} is already registered ({REWARDS[name]!r}); "
                "pick another name or pass overwrite=True"
            )
        REWARDS[name] = fn
        return fn

    return decorator


def get_reward(name: str) -> RewardFn:
    """The registered reward function called ``name``."""
    try:
        return REWARDS[name]
    except KeyError:
        known = ", ".join(sorted(REWARDS)) or "(none)"
        raise KeyError(f"unknown reward {name!r}; registered rewards: {known}") from None


def reward_name(fn: RewardFn) -> str:
    """A readable name for an unregistered reward callable (used as its key in results)."""
    for registered, candidate in REWARDS.items():
        if candidate is fn:
            return registered
    return getattr(fn, "__name__", None) or type(fn).__name__
