"""The reward protocol and the name -> function registry.

A reward function scores one completion: ``fn(prompt, completion, metadata) -> float``. ``metadata`` is the
dataset row's extra fields (``metadata["answer"]`` for verifiable tasks). Register one with::

    @register_reward("my_reward")
    def my_reward(prompt: str, completion: str, metadata: dict) -> float: ...

and refer to it by name in ``RewardRunner`` specs or the ``reward/`` configs. A config can also name a function by
import path, ``package.module:function`` (importable from PYTHONPATH or the working directory), with no registration.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from ..registry import Registry, UnknownNameError

RewardFn = Callable[[str, str, dict[str, Any]], float]

REWARDS: Registry[RewardFn] = Registry("reward")
register_reward = REWARDS.register  # decorator: @register_reward("name") def fn(prompt, completion, metadata)


def get_reward(name: str) -> RewardFn:
    """The reward registered as `name`, or the function at import path `package.module:function`."""
    if name in REWARDS or ":" not in name:
        return REWARDS.lookup(name)
    module_name, _, attr = name.partition(":")
    try:
        module = _import(module_name)
    except ImportError as e:
        raise UnknownNameError(f"reward {name!r}: cannot import {module_name!r} ({e}); it must be importable from "
                               "PYTHONPATH or the working directory") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise UnknownNameError(f"reward {name!r}: {module_name!r} ({getattr(module, '__file__', '?')}) has no "
                               f"function {attr!r}")
    return fn


def _import(module_name: str):
    """Import a module, from the working directory too (`python -m` puts it on sys.path, the console script does
    not): it joins sys.path for this import only."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError:
        if os.getcwd() in sys.path:
            raise
    sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(module_name)
    finally:
        sys.path.remove(os.getcwd())


def reward_name(fn: RewardFn) -> str:
    """A readable name for an unregistered reward callable (used as its key in results)."""
    for registered, candidate in REWARDS.items():
        if candidate is fn:
            return registered
    return getattr(fn, "__name__", None) or type(fn).__name__
