"""Lightning strategies that place the rollout engine (and the free reference policy) on the node.

- `ColocatedRLStrategy`: trainer, engine and reference share one device and one copy of the packed base; the
  engine reads adapter slots of the trainer's own model, so a push is a device-local copy.
- `DedicatedRolloutStrategy`: the engine runs on its own GPU with its own copy of the base (one per GPU); pushes
  copy only the adapter across devices. The reference policy stays with the trainer (adapter disabled).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from lightning.pytorch.strategies import SingleDeviceStrategy


class ColocatedRLStrategy(SingleDeviceStrategy):
    strategy_name = "orbit_colocated"

    def setup(self, trainer) -> None:
        super().setup(trainer)
        module = self.lightning_module
        if module.engine is None:
            module.engine = module.build_engine()


class DedicatedRolloutStrategy(SingleDeviceStrategy):
    strategy_name = "orbit_dedicated"

    def __init__(self, train_device: torch.device, rollout_device: torch.device,
                 rollout_model_factory: Callable[[torch.device], torch.nn.Module], **kw):
        if train_device == rollout_device:
            raise ValueError(f"dedicated rollout needs two devices; both are {train_device}. Use the colocated "
                             "strategy on a single GPU")
        super().__init__(device=train_device, **kw)
        self.rollout_device, self.rollout_model_factory = rollout_device, rollout_model_factory

    def setup(self, trainer) -> None:
        super().setup(trainer)
        module = self.lightning_module
        if module.engine is None:
            module.engine = module.build_engine(self.rollout_model_factory(self.rollout_device))
