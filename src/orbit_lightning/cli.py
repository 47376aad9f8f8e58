"""`orbit-rl`: the console command. No arguments runs the embedded default experiment.

    orbit-rl                                   # default: RL on the shipped tiny MoE, INT4 base + LoRA, CPU ok
    orbit-rl experiment=smoke trainer.max_steps=5
    orbit-rl mode=print_config algo=dr_grpo
    orbit-rl mode=pretrain                     # re-create the shipped tiny model
    orbit-rl mode=eval adapter_path=runs/default/adapter
    orbit-rl mode=plan_memory model=qwen3_30b_a3b
"""

from __future__ import annotations

import json
import logging
import re
import sys
import warnings
from pathlib import Path

# Lines that dependencies print on every start and that say nothing about the run, by logger: torchao's optional
# CUDA extensions, which a CPU build of torch cannot load and none of our kernels use; torch's deprecation of the enum
# registration torchao does on import; Lightning's advertisement for its cloud logger. The command drops them (the
# library leaves every logger alone).
STARTUP_NOISE = {
    "torchao": "Failed to load",
    "torch.utils._pytree": "is an Enum subclass and is now natively supported",
    "lightning.pytorch.utilities.rank_zero": "try installing [litlogger]",
}
# ... and a warning: Lightning's own pytree helper builds torch's deprecated LeafSpec (a FutureWarning aimed at it)
STARTUP_WARNING = "`isinstance(treespec, LeafSpec)` is deprecated"


class _Drop(logging.Filter):
    def __init__(self, needle: str):
        super().__init__()
        self.needle = needle

    def filter(self, record: logging.LogRecord) -> bool:
        return self.needle not in record.getMessage()


def quiet_startup_noise() -> None:
    for name, needle in STARTUP_NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in logger.filters):  # (main() may run more than once in a process)
            logger.addFilter(_Drop(needle))
    warnings.filterwarnings("ignore", message=re.escape(STARTUP_WARNING))


def config_dir() -> Path:
    # Installed: the YAML tree ships as package data (orbit_lightning/conf); editable: the repo's configs/.
    import orbit_lightning.conf as conf

    return Path(conf.__file__).resolve().parent


def compose(overrides: list[str]):
    """Hydra-compose `config.yaml` + overrides onto the `ExperimentConfig` schema -> a validated dataclass."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from .experiment import ExperimentConfig

    ConfigStore.instance().store(name="orbit_schema", node=ExperimentConfig)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
        raw = hydra_compose(config_name="config", overrides=overrides)
    check_keys(OmegaConf.to_container(raw, resolve=False), ExperimentConfig)
    cfg: ExperimentConfig = OmegaConf.to_object(raw)
    cfg.validate()
    return cfg, OmegaConf.to_yaml(raw)


def check_keys(node: dict, schema: type, prefix: str = "") -> None:
    """Every key must be a field of its dataclass (Hydra lets `+key=value` through; we do not)."""
    import dataclasses
    import typing

    fields = {f.name: f for f in dataclasses.fields(schema)}
    hints = typing.get_type_hints(schema)
    for key, value in node.items():
        if key not in fields:
            raise ValueError(unknown_key(prefix + key, fields))
        sub = hints[key]
        if dataclasses.is_dataclass(sub) and isinstance(value, dict):
            check_keys(value, sub, f"{prefix}{key}.")


def unknown_key(full_key: str, fields) -> str:
    return f"unknown config key '{full_key}'; valid keys here: {sorted(fields)}"


def explain(error: Exception) -> str:
    """A configuration error in one message. Hydra's text for a bad override keeps what was wrong in __cause__
    ("Error merging override optim.lr=fast" hides "'fast' could not be converted to Float"), and for a misspelled key
    it suggests `+key=value`, which check_keys refuses: name the key and the valid ones instead."""
    import dataclasses
    import typing

    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException

    from .experiment import ExperimentConfig

    cause = error.__cause__
    missing = error if isinstance(error, MissingMandatoryValue) else cause
    if isinstance(missing, MissingMandatoryValue) and missing.full_key:  # a group's `???` left unset
        return f"{missing.full_key} has no value; set it: {missing.full_key}=<value>"
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and cause.full_key:
        parts, schema = cause.full_key.split("."), ExperimentConfig
        for i, part in enumerate(parts):  # down the schema to the first key that is not a field
            fields = [f.name for f in dataclasses.fields(schema)]
            if part not in fields:
                return unknown_key(".".join(parts[: i + 1]), fields)
            schema = typing.get_type_hints(schema)[part]
            if not dataclasses.is_dataclass(schema):
                break
    if isinstance(cause, OmegaConfBaseException):
        return f"{str(error).splitlines()[0]}: {str(cause).splitlines()[0]}"
    return str(error)


def keep_traceback(error: BaseException, run_dir: Path) -> str:
    """Write the error's traceback to <run_dir>/error.log, so the console ends on the one line that says what was
    wrong; returns where it went, or the traceback itself when the file cannot be written (ORBIT_TRACEBACK=1: both)."""
    import os
    import traceback

    text = "".join(traceback.format_exception(error))
    if os.environ.get("ORBIT_TRACEBACK") == "1":
        return text
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "error.log").write_text(text)
    except OSError:
        return text
    return f"(traceback in {run_dir / 'error.log'}; ORBIT_TRACEBACK=1 prints it here)"


def main(argv: list[str] | None = None) -> int:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # Lightning's package logger has its own console handler and still propagates to the root handler above, which
    # printed each of its messages twice.
    logging.getLogger("lightning").propagate = False
    quiet_startup_noise()
    try:
        cfg, yaml = compose(argv)
    except (HydraException, OmegaConfBaseException, ValueError) as e:
        print(f"orbit-rl: bad configuration: {explain(e)}\nSee `orbit-rl mode=print_config` for every key and "
              f"configs/ for the choices of each group.", file=sys.stderr)
        return 2

    from . import train
    from .callbacks import RunInterrupted

    if cfg.mode == "print_config":
        print(yaml)
        return 0
    if cfg.mode == "plan_memory":
        from .planning import plan_memory

        print(plan_memory(cfg))
        return 0
    runner = {"train": train.run_train, "eval": train.run_eval, "pretrain": train.run_pretrain}[cfg.mode]
    try:
        result = runner(cfg)
    except RunInterrupted as e:  # SIGTERM / Ctrl-C at a step boundary, checkpointed (callbacks.FailSafe)
        print(f"orbit-rl: {e}", file=sys.stderr)
        return 128 + e.signum
    except Exception as e:
        print(f"orbit-rl: {type(e).__name__}: {e}\n{keep_traceback(e, Path(cfg.trainer.output_dir))}",
              file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2, default=str))
    if cfg.mode == "train":
        print(f"\nreport: {result.get('report_png')}\nmetrics: {result['metrics_csv']}\nadapter: {result['adapter']}"
              f"\ncheckpoints: {result['checkpoints']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
