"""The engine's double-buffered adapter slots on the trainer's own model (one base in memory).

Two frozen slots, "slot0" and "slot1", live beside the trainer's "train" slot in every adapter layer
(`adapters.slots`). One is active: new sequences start on it. Versions move as follows:

- `stage(version, tensors)` copies a full adapter state into the *inactive* slot (device to device when
  colocated). It never touches the active slot, so decoding continues undisturbed.
- `activate(version)` makes the slot staged with `version` the active one. The engine calls it between steps,
  so a forward never sees a half-switched model.

Policy for sequences in flight when a new version is activated:
- "finish" (default, the double buffer): they finish on the version they started with; the old slot stays
  readable until its last sequence ends. Staging into a slot that sequences still decode with would corrupt
  them, so it raises `AdapterSlotBusy` (check `can_stage()`, keep stepping, or use the async engine, which waits).
- "switch": they move to the new version at the next step (their cached k/v stay those of the old version);
  the old slot is free at once. Each sample records the version of every token (`adapter_versions`).

A model without an adapter has no slots: versions are None and forwards run the base. The slots belong to the
model, so one engine at a time should serve a model (a second one would share and re-initialise them).
"""

from __future__ import annotations

import contextlib

from torch import Tensor, nn

from ..adapters.slots import (
    TRAIN_SLOT,
    adapter_state,
    adapter_state_dict,
    allocate_slots,
    copy_into_slot,
    use_slot,
)

SLOTS = ("slot0", "slot1")
POLICIES = ("finish", "switch")


class AdapterSlotBusy(RuntimeError):
    """Staging would overwrite a slot that in-flight sequences still decode with."""


class AdapterSlots:
    def __init__(self, model: nn.Module, policy: str = "finish"):
        if policy not in POLICIES:
            raise ValueError(f"adapter policy {policy!r} is not one of {POLICIES}")
        self.model, self.policy = model, policy
        self.enabled = getattr(model, "_orbit_adapter_state", None) is not None
        self.version: dict[str, int | None] = dict.fromkeys(SLOTS)
        self.users: dict[str, int] = dict.fromkeys(SLOTS, 0)
        self.active = SLOTS[0]
        self.staged: int | None = None  # version in the inactive slot that was staged and not yet activated
        if self.enabled:
            # Start by serving a copy of the trainer's current adapter, so that optimizer steps on the "train"
            # slot never change what the engine decodes with.
            allocate_slots(model, list(SLOTS))
            state = adapter_state(model)
            copy_into_slot(model, SLOTS[0], adapter_state_dict(model, TRAIN_SLOT))
            self._set_version(SLOTS[0], state.versions.get(TRAIN_SLOT, 0))

    @property
    def inactive(self) -> str:
        return SLOTS[1] if self.active == SLOTS[0] else SLOTS[0]

    @property
    def active_version(self) -> int | None:
        return self.version[self.active]

    def can_stage(self) -> bool:
        return self.users[self.inactive] == 0

    def stage(self, version: int, tensors: dict[str, Tensor]) -> None:
        self._require_adapter("stage_adapter")
        if not isinstance(version, int) or isinstance(version, bool):
            raise TypeError(f"adapter version must be an int, got {version!r}")
        target = self.inactive
        if self.users[target]:
            raise AdapterSlotBusy(
                f"cannot stage version {version}: {self.users[target]} sequence(s) still decode with version "
                f"{self.version[target]} in slot {target!r} (policy 'finish'). Keep stepping the engine until "
                "engine.can_stage() is True, use AsyncRolloutEngine.stage_adapter (it waits), or policy='switch'"
            )
        copy_into_slot(self.model, target, tensors)  # validates every key and shape before writing anything
        self._set_version(target, version)
        self.staged = version

    def activate(self, version: int) -> bool:
        """Switch to the slot staged with `version` -> True; False if nothing is staged and `version` is already
        active (re-staging the active version number, e.g. a resumed run's first push, does switch)."""
        self._require_adapter("activate_adapter")
        if self.staged is not None and self.staged == version:
            self.active, self.staged = self.inactive, None
            return True
        if version == self.active_version:
            return False
        raise KeyError(f"adapter version {version!r} is not staged (active: {self.active_version}, staged: "
                       f"{self.staged}); call stage_adapter({version!r}, state) first")

    def bind(self) -> str | None:
        """A starting sequence takes the active slot -> the slot name (None without an adapter)."""
        if not self.enabled:
            return None
        self.users[self.active] += 1
        return self.active

    def unbind(self, slot: str | None) -> None:
        if slot is not None:
            self.users[slot] -= 1

    @contextlib.contextmanager
    def use(self, slot: str | None):
        """Context in which forwards read `slot`, adapters on: a sample is always the policy of its recorded
        version, even when the engine is driven inside `model.disable_adapter()` (CUDA graphs rely on it too)."""
        if slot is None:
            yield
            return
        state = adapter_state(self.model)
        prev, state.enabled = state.enabled, True
        try:
            with use_slot(self.model, slot):
                yield
        finally:
            state.enabled = prev

    def _set_version(self, slot: str, version: int | None) -> None:
        self.version[slot] = version
        adapter_state(self.model).versions[slot] = version

    def _require_adapter(self, what: str) -> None:
        if not self.enabled:
            raise ValueError(f"{what}: this model has no adapter; call orbit_lightning.add_adapter(model, "
                             "peft_config) before creating the RolloutEngine")
