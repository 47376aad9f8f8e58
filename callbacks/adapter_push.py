"""AdapterPush: after each RL step, stream the trained adapter into the engine's inactive slot, then activate.

Only the adapter moves (MBs), never the base. The engine keeps decoding in-flight requests on the active slot
while the new version is staged; activation is atomic at a decode-step boundary. The version counter and the
lag between trained and served versions are logged and kept in checkpoints.
"""

from __future__ import annotations

import lightning as L

from orbit_lightning.adapters import adapter_state_dict


class AdapterPush(L.Callback):
    def __init__(self, every_n_steps: int = 1):
        if every_n_steps < 1:
            raise ValueError(f"AdapterPush.every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.version = 0  # last version pushed to the engine

    def on_train_start(self, trainer: L.Trainer, pl_module) -> None:
        # A fresh run (or a resumed one) serves exactly what the trainer holds now.
        self._push(pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if pl_module.rl_step % self.every_n_steps == 0:
            with pl_module.phases.phase("push"):
                self._push(pl_module)
        lag = pl_module.rl_step - self.version
        pl_module.log("adapter/version", float(self.version), on_step=True, batch_size=1)
        pl_module.log("adapter/version_lag", float(lag), on_step=True, batch_size=1)

    def _push(self, pl_module) -> None:
        version = pl_module.rl_step
        pl_module.engine.stage_adapter(version, adapter_state_dict(pl_module.model))
        pl_module.engine.activate_adapter(version)
        self.version = version

    def state_dict(self) -> dict:
        return {"version": self.version, "every_n_steps": self.every_n_steps}

    def load_state_dict(self, state_dict: dict) -> None:
        self.version = state_dict["version"]
