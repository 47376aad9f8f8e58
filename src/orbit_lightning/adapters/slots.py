"""Versioned adapter slots, shared by every adapter layer of a model.

An adapter layer owns its trainable tensors (the "train" slot, nn.Parameters) and any number of named frozen
slots (buffers of the same shapes) that a rollout engine stages versions into. One `AdapterState` per model
says which slot every layer reads and whether adapters are on at all, so switching is a single assignment:
atomic with respect to a forward pass, and free (no weights move).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

TRAIN_SLOT = "train"


@dataclass
class AdapterState:
    enabled: bool = True
    active: str = TRAIN_SLOT
    versions: dict[str, int | None] = field(default_factory=lambda: {TRAIN_SLOT: 0})


class AdapterLayer(nn.Module):
    """Base class: subclasses declare `PARAMS` (names of their trainable tensors) and wrap `base_layer`."""

    PARAMS: tuple[str, ...] = ()

    def __init__(self, base_layer: nn.Module, state: AdapterState):
        super().__init__()
        self.base_layer = base_layer
        self._state = state  # a plain attribute: shared, not a submodule
        self._slot_names: list[str] = []

    @property
    def enabled(self) -> bool:
        return self._state.enabled

    def train_tensors(self) -> dict[str, Tensor]:
        return {name: getattr(self, name) for name in self.PARAMS}

    def slot_tensors(self, slot: str) -> dict[str, Tensor]:
        if slot == TRAIN_SLOT:
            return self.train_tensors()
        if slot not in self._slot_names:
            raise KeyError(f"adapter slot {slot!r} does not exist (slots: {[TRAIN_SLOT, *self._slot_names]})")
        return {name: getattr(self, f"slot_{slot}_{name}") for name in self.PARAMS}

    def active_tensors(self) -> dict[str, Tensor] | None:
        """The tensors the forward pass uses now, or None when adapters are disabled (the reference policy)."""
        return self.slot_tensors(self._state.active) if self._state.enabled else None

    def allocate_slot(self, slot: str) -> None:
        if slot in self._slot_names or slot == TRAIN_SLOT:
            return
        for name, p in self.train_tensors().items():
            # Non-persistent: engine slots are runtime state, never checkpointed with the model.
            self.register_buffer(f"slot_{slot}_{name}", torch.zeros_like(p, requires_grad=False), persistent=False)
        self._slot_names.append(slot)


def adapter_layers(model: nn.Module) -> Iterator[tuple[str, AdapterLayer]]:
    for name, module in model.named_modules():
        if isinstance(module, AdapterLayer):
            yield name, module


def adapter_state(model: nn.Module) -> AdapterState:
    state = getattr(model, "_orbit_adapter_state", None)
    if state is None:
        raise ValueError("this model has no adapter; call orbit_lightning.add_adapter(model, peft_config) first")
    return state


def allocate_slots(model: nn.Module, slots: list[str]) -> None:
    state = adapter_state(model)
    for _, layer in adapter_layers(model):
        for slot in slots:
            layer.allocate_slot(slot)
    for slot in slots:
        state.versions.setdefault(slot, None)


@torch.no_grad()
def copy_into_slot(model: nn.Module, slot: str, tensors: dict[str, Tensor]) -> None:
    """Write a full adapter state (keys `{layer path}.{param}`, as `adapter_state_dict` gives) into `slot`.

    Every key and shape is checked before anything is written, so a bad state leaves the slot untouched.
    """
    targets = {f"{path}.{n}": t for path, layer in adapter_layers(model) for n, t in layer.slot_tensors(slot).items()}
    missing, extra = targets.keys() - tensors.keys(), tensors.keys() - targets.keys()
    if missing or extra:
        raise ValueError(f"adapter state does not match the model's adapter: missing {sorted(missing)[:3]}, "
                         f"unexpected {sorted(extra)[:3]}")
    for key, t in targets.items():
        if t.shape != tensors[key].shape:
            raise ValueError(f"adapter tensor {key}: shape {tuple(tensors[key].shape)} != slot shape {tuple(t.shape)}")
    for key, t in targets.items():
        t.copy_(tensors[key], non_blocking=True)


def adapter_state_dict(model: nn.Module, slot: str = TRAIN_SLOT) -> dict[str, Tensor]:
    return {f"{path}.{n}": t for path, layer in adapter_layers(model) for n, t in layer.slot_tensors(slot).items()}


@contextlib.contextmanager
def use_slot(model: nn.Module, slot: str):
    """Run forwards with `slot` (e.g. an engine's active version); restores the previous slot after."""
    state = adapter_state(model)
    if slot != TRAIN_SLOT and slot not in state.versions:
        raise KeyError(f"adapter slot {slot!r} was never allocated")
    prev, state.active = state.active, slot
    try:
        yield
    finally:
        state.active = prev


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    state = getattr(model, "_orbit_adapter_state", None)
    if state is None:  # no adapter: the model already is the reference
        yield model
        return
    prev, state.enabled = state.enabled, False
    try:
        yield model
    finally:
        state.enabled = prev
