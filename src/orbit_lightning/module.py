"""`RLModule`: one RL step per Lightning training step (manual optimization).

rollout (engine, active adapter version) → rewards → advantages → old / reference log-probs (no_grad; the
reference is the same base with the adapter disabled) → K minibatch updates of the adapter → push (callback).
Subclass and override `compute_rewards`, or register a reward function by name (rewards.register_reward).
"""

from __future__ import annotations

import logging
import math
import random
from typing import Any

import lightning as L
import numpy as np
import torch
from torch import nn

from .adapters import adapter_state_dict, copy_into_slot, trainable_parameters
from .algorithms import get_advantage, group_keep_mask, kl_penalized_rewards, pass_at_k
from .algorithms.config import AlgoConfig
from .models.invariant import invariant_mode
from .rewards.runner import RewardResult, RewardRunner
from .rl.config import OptimConfig, RolloutConfig
from .rl.experience import Experience, Samples
from .rl.loss import loss_denominator, micro_batch_loss, micro_batches, score_no_grad
from .rl.phases import PhaseTimer

log = logging.getLogger(__name__)

_ADDITIVE_METRICS = {"loss/policy", "loss/kl", "entropy"}
FAILED_REWARD_STEPS = 3  # RL steps in a row whose every reward call failed, after which the run stops


class RLModule(L.LightningModule):
    def __init__(
        self,
        model: nn.Module,  # frozen (packed) base with an adapter added
        tokenizer: Any,
        rewards: RewardRunner | None = None,
        algo: AlgoConfig | None = None,
        rollout: RolloutConfig | None = None,
        optim: OptimConfig | None = None,
        seed: int = 0,
        engine: Any = None,  # a RolloutEngine; the strategy or `setup` provides one when None
    ):
        super().__init__()
        self.model, self.tokenizer, self.rewards = model, tokenizer, rewards
        self.algo = algo or AlgoConfig()
        self.rollout_cfg, self.optim_cfg = rollout or RolloutConfig(), optim or OptimConfig()
        for c in (self.algo, self.rollout_cfg, self.optim_cfg):
            c.validate()
        self.seed = seed
        self.engine = engine
        self.automatic_optimization = False
        self.strict_loading = False  # checkpoints hold the adapter only, never the frozen base
        self.rl_step = 0
        self.phases = PhaseTimer()
        self.last_eval: dict[str, float] = {}
        self._refill_sampler = None  # DAPO dynamic sampling's extra prompts (seeded, checkpointed)
        self._refill_state: dict | None = None
        self.failed_reward_steps = 0  # consecutive, checkpointed
        self._first_reward_failure = ""

    # ---- setup -------------------------------------------------------------------------------------

    def setup(self, stage: str) -> None:
        self.phases.device = self.device

    def on_fit_start(self) -> None:
        # After the strategy's setup, which places the engine (colocated or on its own GPU); a plain Trainer
        # without our strategies gets a colocated engine here.
        if self.engine is None:
            self.engine = self.build_engine()

    def build_engine(self, model: nn.Module | None = None):
        """The rollout engine as `rollout` configures it, on `model` (default: the trainer's own, colocated)."""
        from .rollout import RolloutEngine

        r = self.rollout_cfg
        return RolloutEngine(self.model if model is None else model, tokenizer=self.tokenizer,
                             kv_budget_bytes=r.kv_budget_bytes, kv_fraction=r.kv_fraction, block_size=r.block_size,
                             max_batch_size=r.max_batch_size, cuda_graphs=r.cuda_graphs,
                             deterministic=r.deterministic, decode_steps=r.decode_steps)

    def configure_optimizers(self):
        o = self.optim_cfg
        params = trainable_parameters(self.model)
        if not params:
            raise ValueError("the model has no trainable parameters; add an adapter (orbit_lightning.add_adapter)")
        opt = torch.optim.AdamW(params, lr=o.lr, weight_decay=o.weight_decay, betas=tuple(o.betas))
        if o.schedule == "cosine" and self.trainer.max_steps <= 0:
            raise ValueError("optim.schedule=cosine needs the Trainer's max_steps (the schedule's length); set "
                             "trainer.max_steps or use optim.schedule=constant")
        total = max(1, self.trainer.max_steps)

        def factor(step: int) -> float:
            warm = min(1.0, (step + 1) / o.warmup_steps) if o.warmup_steps else 1.0
            if o.schedule == "cosine":
                return warm * 0.5 * (1 + math.cos(math.pi * min(step, total) / total))
            return warm

        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.LambdaLR(opt, factor)}

    # ---- rewards (override point) ------------------------------------------------------------------

    def compute_rewards(self, prompts: list[str], completions: list[str], metadata: list[dict]) -> RewardResult:
        """Rewards for N (prompt, completion) pairs. Override in a subclass, or configure registered functions."""
        if self.rewards is None:
            raise ValueError("no reward functions configured; pass rewards=RewardRunner(...) or override "
                             "RLModule.compute_rewards")
        return self.rewards(prompts, completions, metadata)

    # ---- one RL step -------------------------------------------------------------------------------

    def sampling_params(self, n: int, temperature: float, seed: int, max_new_tokens: int | None = None):
        from .rollout import SamplingParams

        r = self.rollout_cfg
        stops = list(r.stop_token_ids) or [self.tokenizer.eos_token_id]
        return SamplingParams(n=n, temperature=temperature, top_p=r.top_p if temperature > 0 else 1.0,
                              top_k=r.top_k if temperature > 0 else -1,
                              max_new_tokens=max_new_tokens or r.max_new_tokens, stop_token_ids=stops,
                              seed=seed, ignore_eos=r.ignore_eos)

    def generate(self, items: list[dict], n: int, temperature: float, salt: int):
        # Seeds derive from (run seed, step, prompt index): a resumed run regenerates the same samples.
        params = [self.sampling_params(n, temperature, mix_seed(self.seed, salt, it["index"])) for it in items]
        return self.engine.generate([it["prompt_ids"] for it in items], params)

    def sample(self, items: list[dict], salt: int) -> tuple[Samples, int]:
        """Generate G samples per prompt and score them -> (samples, number of prompts the engine rejected)."""
        outputs = self.generate(items, self.rollout_cfg.group_size, self.rollout_cfg.temperature, salt=salt)
        rejected = [(it, out.error) for it, out in zip(items, outputs, strict=True) if getattr(out, "error", None)]
        for it, err in rejected:  # e.g. a prompt longer than the context: skip it, keep the run going
            log.warning("rl_step %d: prompt %s rejected by the rollout engine: %s", self.rl_step, it["index"], err)
        if len(rejected) == len(items):
            raise ValueError(f"every prompt of rl_step {self.rl_step} was rejected by the rollout engine, e.g. "
                             f"{rejected[0][1]}; check data.max_prompt_tokens against the model's context")
        rows = [(it, c) for it, out in zip(items, outputs) if not getattr(out, "error", None) for c in out.outputs]
        texts = [self.tokenizer.decode(c.token_ids) for _, c in rows]
        prompts = [it["prompt"] for it, _ in rows]
        result = self.compute_rewards(prompts, texts, [{**it.get("metadata", {}), "answer": it.get("answer")}
                                                       for it, _ in rows])
        self._first_reward_failure = result.failures[0] if result.failures else "every reward was NaN"
        samples = Samples(prompt_ids=[it["prompt_ids"] for it, _ in rows],
                          completion_ids=[list(c.token_ids) for _, c in rows],
                          logprobs=[list(c.logprobs) for _, c in rows], prompts=prompts, completions=texts,
                          versions=[-1 if c.adapter_version is None else int(c.adapter_version) for _, c in rows],
                          rewards=result.rewards.float(), valid=result.valid.bool(), per_function=result.per_function)
        return samples, len(rejected)

    def _count_failed_rewards(self, valid: torch.Tensor) -> None:
        """An RL step whose every reward failed trains nothing (its samples are masked): one is a passing outage, but
        FAILED_REWARD_STEPS in a row is a broken reward, and the run stops (FailSafe keeps its state) rather than
        "succeed" having learnt nothing. valid: [N] bool, the step's samples after any dynamic-sampling rounds."""
        if bool(valid.any()):
            self.failed_reward_steps = 0
            return
        self.failed_reward_steps += 1
        if self.failed_reward_steps >= FAILED_REWARD_STEPS:
            raise RuntimeError(f"every reward call failed in {self.failed_reward_steps} RL steps in a row (up to "
                               f"rl_step {self.rl_step + 1}), e.g. {self._first_reward_failure}; fix the reward "
                               "function (reward=...) or its server, then resume with trainer.resume=auto")

    def collect(self, items: list[dict]) -> tuple[Experience, dict[str, float]]:
        """Rollout + rewards -> an Experience (without advantages/log-probs yet).

        With `algo.dynamic_sampling` (DAPO), groups whose rewards are all equal carry no signal: they are dropped
        and more prompts (from a seeded refill stream saved in checkpoints) are generated until the batch is full
        again or `algo.max_sampling_rounds` is reached.
        """
        g = self.rollout_cfg.group_size
        samples, rejected = self.sample(items, salt=self.rl_step)
        metrics: dict[str, float] = {}
        if self.algo.dynamic_sampling:
            samples, metrics = self._refill(samples, len(items))
        self._count_failed_rewards(samples.valid)
        exp = samples.to_experience(g, self.tokenizer.pad_token_id)
        valid, cmask = exp.reward_valid, exp.completion_mask
        metrics.update({"reward/mean": float(samples.rewards[valid].sum()) / max(int(valid.sum()), 1),
                        "rollout/rejected_prompts": float(rejected),
                        "reward/failed_fraction": 1.0 - valid.float().mean().item(),
                        "response/length_mean": cmask.sum(-1).mean().item(),
                        "response/length_max": cmask.sum(-1).max().item()})
        for name, vals in samples.per_function.items():
            ok = ~torch.isnan(vals)
            metrics[f"reward/{name}"] = vals[ok].mean().item() if ok.any() else float("nan")
        return exp, metrics

    def _refill(self, samples: Samples, target_groups: int) -> tuple[Samples, dict[str, float]]:
        g = self.rollout_cfg.group_size
        kept, n_kept, rounds = [], 0, 0
        dataset = self.trainer.datamodule.train_dataset
        while True:
            keep = group_keep_mask(samples.rewards, g, samples.valid)
            kept.append(samples.select_groups(keep, g))
            n_kept += int(keep.sum())
            rounds += 1
            if n_kept >= target_groups or rounds >= self.algo.max_sampling_rounds:
                break
            extra = [dataset[i] for i in self.refill_sampler(len(dataset)).next_batch()]
            samples, _ = self.sample(extra, salt=mix_seed(self.rl_step, rounds))
        out = Samples.concat(kept)
        n = min(n_kept, target_groups) * g
        if n == 0:  # nothing informative after every round: train on the last round (zero advantages)
            return samples, {"dynamic_sampling/rounds": float(rounds), "dynamic_sampling/kept_groups": 0.0}
        out = out.select_groups(torch.arange(n_kept) < target_groups, g) if n_kept > target_groups else out
        return out, {"dynamic_sampling/rounds": float(rounds), "dynamic_sampling/kept_groups": float(n_kept)}

    def refill_sampler(self, num_items: int):
        if self._refill_sampler is None:
            from .data.sampler import ResumableBatchSampler

            self._refill_sampler = ResumableBatchSampler(num_items, self.trainer.datamodule.prompts_per_step,
                                                         seed=mix_seed(self.seed, 7))
            if self._refill_state is not None:  # resumed: continue the refill stream where it stopped
                self._refill_sampler.load_state_dict(self._refill_state)
        return self._refill_sampler

    def prepare(self, exp: Experience) -> dict[str, float]:
        """Old and reference log-probs, then advantages (KL may shape the rewards first)."""
        with invariant_mode(self.rollout_cfg.deterministic):  # the engine's arithmetic, when it is deterministic
            return self._prepare(exp)

    def _prepare(self, exp: Experience) -> dict[str, float]:
        budget = self.algo.micro_batch_tokens
        with self.phases.phase("old_logprobs"):
            exp.old_logprobs = score_no_grad(self.model, exp, budget)
        m = exp.completion_mask
        diff = (exp.old_logprobs - exp.rollout_logprobs).abs() * m
        metrics = {"rollout/logprob_diff_abs_mean": (diff.sum() / m.sum().clamp(min=1)).item(),
                   "rollout/logprob_diff_abs_max": diff.max().item()}
        rewards = exp.rewards
        if self.algo.kl_coef > 0:
            with self.phases.phase("reference"), self.model.disable_adapter():
                exp.ref_logprobs = score_no_grad(self.model, exp, budget)
            kl_tok = (exp.old_logprobs - exp.ref_logprobs) * exp.loss_mask
            metrics["kl/ref"] = (kl_tok.sum(-1)).mean().item()
            if self.algo.kl_in_reward:
                rewards = kl_penalized_rewards(rewards, exp.old_logprobs, exp.ref_logprobs, exp.loss_mask,
                                               beta=self.algo.kl_coef)
        exp.advantages = get_advantage(self.algo.advantage)(rewards, exp.group_size, exp.reward_valid)
        return metrics

    def update(self, exp: Experience) -> dict[str, float]:
        with invariant_mode(self.rollout_cfg.deterministic):  # policy log-probs computed as `prepare` did
            return self._update(exp)

    def _update(self, exp: Experience) -> dict[str, float]:
        opt, sched = self.optimizers(), self.lr_schedulers()
        a = self.algo
        max_tokens = a.max_tokens or self.rollout_cfg.max_new_tokens
        sums: dict[str, float] = {}
        micro_count = steps = 0
        gen = torch.Generator().manual_seed(mix_seed(self.seed, 1 << 20, self.rl_step))
        for _ in range(a.updates_per_step):
            order = torch.randperm(exp.num_samples, generator=gen)
            # Always exactly `minibatches` optimizer steps (an empty piece is a no-op step), so Lightning's
            # global_step stays rl_step * updates_per_step * minibatches and checkpoint cadence holds.
            for mb_rows in torch.tensor_split(order, a.minibatches):
                mb = exp.select(mb_rows)
                denom = loss_denominator(mb.loss_mask, a.loss_agg)
                for rows in micro_batches(torch.arange(len(mb_rows)), mb, a.micro_batch_tokens):
                    loss, metrics = micro_batch_loss(self.model, mb.select(rows), a, denom, max_tokens)
                    self.manual_backward(loss)
                    for k, v in metrics.items():
                        sums[k] = sums.get(k, 0.0) + float(v)
                    micro_count += 1
                norm = torch.nn.utils.clip_grad_norm_(trainable_parameters(self.model), a.grad_clip)
                if not torch.isfinite(norm):
                    opt.zero_grad(set_to_none=True)
                    raise FloatingPointError(
                        f"non-finite gradient norm at rl_step {self.rl_step} (optimizer step {steps + 1} of this "
                        f"RL step); this step's update was skipped; a crash checkpoint is written")
                sums["grad_norm"] = sums.get("grad_norm", 0.0) + float(norm)
                opt.step()
                opt.zero_grad(set_to_none=True)
                sched.step()
                steps += 1
        # Loss terms are partial sums over a minibatch's micro-batches (each divides by the whole minibatch's
        # denominator): average them per optimizer step. Ratios and fractions are per-micro-batch statistics.
        out = {k: v / (steps if k in _ADDITIVE_METRICS else max(micro_count, 1)) for k, v in sums.items()}
        out["grad_norm"] = sums.get("grad_norm", 0.0) / max(steps, 1)
        out["lr"] = sched.get_last_lr()[0]
        return out

    def training_step(self, batch: list[dict], batch_idx: int) -> None:
        self.phases.last.clear()
        with self.phases.phase("rollout"):
            exp, metrics = self.collect(batch)
        exp = exp.to(self.device)
        metrics.update(self.prepare(exp))
        with self.phases.phase("train"):
            self.model.train()
            metrics.update(self.update(exp))
            self.model.eval()
        self.rl_step += 1
        metrics["rl_step"] = float(self.rl_step)
        metrics["rollout/adapter_version_mean"] = exp.adapter_versions.float().mean().item()
        self._log(metrics)

    def _log(self, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self.log(k, v, prog_bar=k == "reward/mean", on_step=True, on_epoch=False, batch_size=1)
        if "eval/accuracy" in self.last_eval:  # the Eval callback logs eval/* itself; this is the bar only
            self.log("eval_acc", self.last_eval["eval/accuracy"], prog_bar=True, logger=False, batch_size=1)

    # ---- evaluation (used by the Eval callback) -----------------------------------------------------

    @torch.no_grad()
    def evaluate(self, items: list[dict], k: int) -> tuple[dict[str, float], list[dict]]:
        """Greedy accuracy and unbiased pass@k (k samples at eval temperature) over `items`."""
        self.model.eval()
        greedy = self.generate(items, 1, 0.0, salt=-1)
        sampled = self.generate(items, k, self.rollout_cfg.eval_temperature, salt=-2) if k > 1 else None
        prompts = [it["prompt"] for it in items]
        meta = [{**it.get("metadata", {}), "answer": it.get("answer")} for it in items]
        # A prompt the engine rejects (e.g. too long for the context) counts as wrong, and is reported.
        ok = torch.tensor([not getattr(o, "error", None) for o in greedy])
        g_text = [self.tokenizer.decode(o.outputs[0].token_ids) if o.outputs else "" for o in greedy]
        g_rew = self.compute_rewards(prompts, g_text, meta)
        correct = (g_rew.rewards > 0.5) & g_rew.valid & ok
        metrics = {"eval/accuracy": correct.float().mean().item(), "eval/rejected": float((~ok).sum())}
        if sampled is not None:
            texts = [self.tokenizer.decode(o.outputs[j].token_ids) if j < len(o.outputs) else ""
                     for o in sampled for j in range(k)]
            rep = [x for x in prompts for _ in range(k)], [m for m in meta for _ in range(k)]
            s_rew = self.compute_rewards(rep[0], texts, rep[1])
            hits = (s_rew.rewards > 0.5) & s_rew.valid & ok.repeat_interleave(k)
            n_correct = hits.view(len(items), k).sum(-1)
            for kk in sorted({1, k}):
                metrics[f"eval/pass@{kk}"] = pass_at_k(n_correct, k, kk).mean().item()
        table = [{"prompt": p, "answer": m.get("answer"), "greedy": t, "correct": bool(c)}
                 for p, m, t, c in zip(prompts, meta, g_text, correct.tolist())]
        return metrics, table

    # ---- checkpoints: the adapter, optimizer, RNG; never the frozen base ----------------------------

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["state_dict"] = {f"adapter.{k}": v.detach().cpu() for k, v in adapter_state_dict(self.model).items()}
        checkpoint["orbit"] = {"rl_step": self.rl_step, "rng": _rng_state(),
                               "optimizer_steps_per_rl_step": self.algo.optimizer_steps_per_rl_step,
                               "failed_reward_steps": self.failed_reward_steps,
                               "refill": self._refill_sampler.state_dict() if self._refill_sampler
                               else self._refill_state}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = {k.removeprefix("adapter."): v for k, v in checkpoint["state_dict"].items()}
        try:
            copy_into_slot(self.model, "train", state)
        except ValueError as e:
            raise ValueError(f"the checkpoint's adapter does not fit this run's ({e}); resume with the adapter.* "
                             "settings the run was started with") from None
        checkpoint["state_dict"] = {}
        orbit = checkpoint.get("orbit", {})
        self.rl_step = orbit.get("rl_step", 0)
        self.failed_reward_steps = orbit.get("failed_reward_steps", 0)
        if "rng" in orbit:
            _set_rng_state(orbit["rng"])
        self._refill_state = orbit.get("refill")


def mix_seed(*values: int) -> int:
    """A deterministic 31-bit seed from integers (Python's hash() of str is salted per process)."""
    h = 0x9E3779B9
    for v in values:
        h = (h ^ (v & 0xFFFFFFFFFFFF)) * 0x100000001B3 % (1 << 61)
    return h % (2**31)


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])

