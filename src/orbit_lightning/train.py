"""Run modes of `orbit-rl`: train (the RL loop), eval (an adapter), pretrain, plan_memory."""

from __future__ import annotations

import logging
import signal
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .build import build_data, build_logger, build_model, build_rewards, build_tokenizer, resolve_device
from .experiment import ExperimentConfig

if TYPE_CHECKING:
    from .checkpoint_io import CheckpointSteps

log = logging.getLogger(__name__)


def make_trainer(cfg: ExperimentConfig, module, run_dir: Path, eval_items: list[dict], model_factory,
                 resume: str | None = None):
    import lightning as L

    from .callbacks import AdapterPush, EvalCallback, FailSafe, MemoryTracker, RLStepCheckpoint
    from .checkpoint_io import AtomicCheckpointIO, checkpoint_steps
    from .strategies import ColocatedRLStrategy, DedicatedRolloutStrategy

    device = resolve_device(cfg.model.device)
    if cfg.strategy.name == "dedicated":  # (ExperimentConfig.validate made sure rollout_device is set)
        rollout_device = resolve_device(cfg.strategy.rollout_device, "strategy.rollout_device")
        strategy = DedicatedRolloutStrategy(device, rollout_device, model_factory, checkpoint_io=AtomicCheckpointIO())
    else:
        strategy = ColocatedRLStrategy(device=device, checkpoint_io=AtomicCheckpointIO())
    # A Lightning warning about what this loop does on purpose: the model sits in eval mode outside its updates (no
    # adapter dropout in rollouts and scoring).
    warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode at the start of training")
    opt_steps = cfg.algo.optimizer_steps_per_rl_step
    resumed = checkpoint_steps(resume) if resume else None
    if resumed:
        if resumed.per_rl_step and resumed.per_rl_step != opt_steps:
            log.info("%s was written at %d optimizer steps per RL step, this run takes %d (algo.updates_per_step x "
                     "algo.minibatches): trainer.max_steps still counts RL steps", resume, resumed.per_rl_step,
                     opt_steps)
        partial = resumed.global_step - resumed.rl_step * (resumed.per_rl_step or opt_steps)
        if partial:  # e.g. a crash.ckpt written part-way through an RL step's updates
            log.warning("%s is not at an RL-step boundary (%d optimizer steps after RL step %d): the run continues "
                        "from it, with the part of RL step %d's update it holds", resume, partial, resumed.rl_step,
                        resumed.rl_step + 1)
    ckpt_dir = run_dir / "checkpoints"
    t = cfg.trainer
    evals = [EvalCallback(eval_items, every_n_steps=t.eval_every, k=cfg.rollout.eval_k, max_items=t.eval_max_items,
                          output_dir=str(run_dir))] if t.eval_every else []  # eval_every=0: no evaluation
    callbacks = [
        FailSafe(ckpt_dir),  # first: its signal handlers then cover the evaluation before the first step
        AdapterPush(),
        MemoryTracker(),
        *evals,
        RLStepCheckpoint(ckpt_dir, cfg.trainer.checkpoint_every),  # (after the evaluation of its step)
    ]
    return L.Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu", devices=1, strategy=strategy,
        max_steps=optimizer_step_budget(cfg.trainer.max_steps, opt_steps, resumed),
        logger=build_logger(cfg, run_dir, resumed.rl_step if resumed else None),
        callbacks=callbacks,
        default_root_dir=run_dir, enable_checkpointing=False,  # (RLStepCheckpoint instead of ModelCheckpoint)
        limit_val_batches=0, num_sanity_val_steps=0, log_every_n_steps=1, enable_model_summary=False,
        deterministic=False,
    )


def optimizer_step_budget(rl_steps: int, per_rl_step: int, resumed: CheckpointSteps | None = None) -> int:
    """Lightning's max_steps (optimizer steps) for a run of `rl_steps` RL steps of `per_rl_step` optimizer steps each,
    resumed from a checkpoint_io.CheckpointSteps or not: the steps still to run are counted on from the checkpoint's
    optimizer steps, so trainer.max_steps stays a count of RL steps when algo.minibatches or updates_per_step changed
    between the runs (Lightning stops between RL steps, once global_step reaches it)."""
    if resumed is None:
        return rl_steps * per_rl_step
    return resumed.global_step + max(0, rl_steps - resumed.rl_step) * per_rl_step


def resolve_resume(cfg: ExperimentConfig, run_dir: Path) -> str | None:
    r = cfg.trainer.resume
    if r == "auto":  # every step boundary a run keeps, periodic or on a signal (callbacks.FailSafe), is last.ckpt
        last = run_dir / "checkpoints" / "last.ckpt"
        if not last.is_file():
            return None
        log.info("trainer.resume=auto: resuming from %s", last)
        return str(last)
    if r is not None and not Path(r).is_file():
        raise FileNotFoundError(f"trainer.resume={r!r}: no such checkpoint file")
    return r


def run_train(cfg: ExperimentConfig) -> dict:
    from . import save_adapter
    from .module import RLModule
    from .report import write_report

    if cfg.trainer.threads:
        torch.set_num_threads(cfg.trainer.threads)
    torch.manual_seed(cfg.trainer.seed)
    run_dir = Path(cfg.trainer.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    resume = resolve_resume(cfg, run_dir)  # fail before loading anything
    resolve_device(cfg.model.device)
    if cfg.strategy.name == "dedicated":
        resolve_device(cfg.strategy.rollout_device, "strategy.rollout_device")
    rewards = build_rewards(cfg.reward)  # an unknown name or import path fails here too
    model = build_model(cfg.model, cfg.adapter)  # (first: a wrong model.path is named before any tokenizer warning)
    tokenizer = build_tokenizer(cfg.model)
    dm, eval_items = build_data(cfg.data, tokenizer, cfg.trainer.seed, model.config.max_position_embeddings)

    def rollout_model(device: torch.device):
        spec = type(cfg.model)(**{**asdict(cfg.model), "device": str(device)})
        return build_model(spec, cfg.adapter)

    module = RLModule(model, tokenizer, rewards=rewards, algo=cfg.algo, rollout=cfg.rollout, optim=cfg.optim,
                      seed=cfg.trainer.seed)
    trainer = make_trainer(cfg, module, run_dir, eval_items, rollout_model, resume)
    try:
        trainer.fit(module, datamodule=dm, ckpt_path=resume)
    except SystemExit:  # Lightning's SIGTERMException, or its exit after a KeyboardInterrupt
        from .callbacks import FailSafe

        stopped = next(c.interrupted for c in trainer.callbacks if isinstance(c, FailSafe))
        if stopped is None:
            raise
        if stopped.mid_step or trainer.global_step < trainer.max_steps:
            raise stopped from None
        # (Lightning's fit loop raises the SIGTERM flag also after the last step: the run is complete, so finish it)
        log.warning("received %s after the last step: finishing the run", signal.Signals(stopped.signum).name)

    adapter_dir = save_adapter(model, run_dir / "adapter", base_model_name_or_path=cfg.model.path)
    eval_cb = next((c for c in trainer.callbacks if type(c).__name__ == "EvalCallback"), None)
    history = eval_cb.history if eval_cb is not None else []  # trainer.eval_every=0: no evaluation
    out = {"run_dir": str(run_dir), "metrics_csv": str(run_dir / "metrics.csv"), "adapter": str(adapter_dir),
           "checkpoints": str(run_dir / "checkpoints"), "eval": history}
    if cfg.trainer.report and cfg.logger.kind == "csv":
        png, js = write_report(run_dir, history)
        out.update(report_png=str(png), report_json=str(js))
    return out


def run_eval(cfg: ExperimentConfig) -> dict:
    from . import load_adapter
    from .module import RLModule

    rewards = build_rewards(cfg.reward)  # before anything loads
    model = build_model(cfg.model, None if cfg.adapter_path else cfg.adapter)
    tokenizer = build_tokenizer(cfg.model)
    if cfg.adapter_path:
        load_adapter(model, cfg.adapter_path)
    _, eval_items = build_data(cfg.data, tokenizer, cfg.trainer.seed, model.config.max_position_embeddings)
    module = RLModule(model, tokenizer, rewards=rewards, algo=cfg.algo, rollout=cfg.rollout, optim=cfg.optim,
                      seed=cfg.trainer.seed)
    module.engine = module.build_engine()
    metrics, _ = module.evaluate(eval_items[: cfg.trainer.eval_max_items], cfg.rollout.eval_k)
    return metrics


def run_pretrain(cfg: ExperimentConfig) -> dict:
    from .data.tasks import ArithmeticTaskConfig
    from .pretrain import PretrainConfig, pretrain

    d, p = cfg.data, cfg.pretrain
    task = ArithmeticTaskConfig(num_digits_min=d.num_digits_min, num_digits_max=d.num_digits_max, ops=tuple(d.ops),
                                num_operands=d.num_operands, seed=d.task_seed, train_size=d.train_size,
                                eval_size=d.eval_size)
    out = pretrain(PretrainConfig(output_dir=p.output_dir, task=task, seed=cfg.trainer.seed, batch_size=p.batch_size,
                                  lr=p.lr, max_steps=p.max_steps, eval_every=p.eval_every,
                                  target_accuracy=p.target_accuracy, threads=cfg.trainer.threads or 2))
    return {"checkpoint": str(out)}
