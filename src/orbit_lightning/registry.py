"""One name -> handler registry, shared by advantage estimators, policy losses and reward functions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class UnknownNameError(KeyError, ValueError):
    """Raised for a name nobody registered; a KeyError (mapping lookup) and a ValueError (bad config value)."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0])


class Registry(dict[str, T], Generic[T]):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def register(self, name: str, *, overwrite: bool = False) -> Callable[[T], T]:
        """Decorator registering its argument under `name`; a taken name is an error unless `overwrite`."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")

        def decorator(obj: T) -> T:
            if not callable(obj):
                raise TypeError(f"registering {self.kind} {name!r} needs a callable, got {type(obj).__name__}")
            if name in self and self[name] is not obj and not overwrite:
                raise ValueError(f"{self.kind} {name!r} is already registered ({self[name]!r}); pick another name "
                                 "or pass overwrite=True")
            self[name] = obj
            return obj

        return decorator

    def lookup(self, name: str) -> T:
        try:
            return self[name]
        except KeyError:
            known = ", ".join(sorted(self)) or "(none)"
            raise UnknownNameError(f"unknown {self.kind} {name!r}; registered: {known}") from None
