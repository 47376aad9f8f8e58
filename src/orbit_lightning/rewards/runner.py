"""Run several reward functions over a batch of completions, concurrently and with a timeout.

A failure (exception, timeout, NaN/inf or non-number) masks that sample instead of stopping the run: one bad
verifier call must not kill a multi-hour RL job.
"""

from __future__ import annotations

import logging
import math
import numbers
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from orbit_lightning.rewards.base import RewardFn, get_reward, reward_name

logger = logging.getLogger(__name__)

_MAX_FAILURES_IN_LOG = 3


@dataclass
class RewardResult:
    rewards: Tensor  # [N] float32, weighted sum over functions; 0 where not valid
    valid: Tensor  # [N] bool, False where any function failed for that sample
    per_function: dict[str, Tensor] = field(default_factory=dict)  # name -> [N] float32, NaN where missing
    failures: list[str] = field(default_factory=list)  # "fn[sample i]: ExcType: message"


class RewardRunner:
    """Weighted sum of reward functions, each called once per sample.

    specs: ``[(name_or_fn, weight), ...]``; a name is looked up in the registry.
    timeout_s: limit for one call, counted from when a worker starts it.
    max_workers: threads running calls at once.
    """

    def __init__(
        self,
        specs: Sequence[tuple[str | RewardFn, float]],
        timeout_s: float = 10.0,
        max_workers: int = 8,
    ) -> None:
        if not specs:
            raise ValueError("RewardRunner needs at least one (name_or_fn, weight) spec")
        if not (timeout_s > 0 and math.isfinite(timeout_s)):
            raise ValueError(f"timeout_s must be a positive finite number of seconds, got {timeout_s!r}")
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.fns: list[RewardFn] = []
        self.names: list[str] = []
        self.weights: list[float] = []
        for spec in specs:
            if not (isinstance(spec, tuple | list) and len(spec) == 2):
                raise TypeError(f"each reward spec must be a (name_or_fn, weight) pair, got {spec!r}")
            fn_or_name, weight = spec
            fn = get_reward(fn_or_name) if isinstance(fn_or_name, str) else fn_or_name
            if not callable(fn):
                raise TypeError(f"reward spec {spec!r}: expected a registered name or a callable")
            name = fn_or_name if isinstance(fn_or_name, str) else reward_name(fn)
            if name in self.names:
                raise ValueError(f"reward {name!r} appears twice in the specs; results are keyed by name")
            if not (isinstance(weight, numbers.Real) and math.isfinite(weight)):
                raise ValueError(f"reward {name!r}: weight must be a finite number, got {weight!r}")
            self.fns.append(fn)
            self.names.append(name)
            self.weights.append(float(weight))
        self.timeout_s = float(timeout_s)
        self.max_workers = int(max_workers)

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[dict[str, Any]]
    ) -> RewardResult:
        n = len(completions)
        if len(prompts) != n or len(metadata) != n:
            raise ValueError(
                f"prompts, completions and metadata must have the same length, got "
                f"{len(prompts)}, {n}, {len(metadata)}"
            )
        tasks = [(f, i) for f in range(len(self.fns)) for i in range(n)]
        values, errors = self._run_all(tasks, prompts, completions, metadata)

        failures = [
            f"{self.names[f]}[sample {i}]: {type(e).__name__}: {e}" for (f, i), e in sorted(errors.items())
        ]
        if failures:
            logger.warning(
                "%d of %d reward calls failed; those samples are masked. First: %s",
                len(failures),
                len(tasks),
                "; ".join(failures[:_MAX_FAILURES_IN_LOG]),
            )
        nan = float("nan")
        table = torch.tensor(  # [F, N] float64: sum the weights in fp64, report in fp32
            [[values.get((f, i), nan) for i in range(n)] for f in range(len(self.fns))], dtype=torch.float64
        ).reshape(len(self.fns), n)
        valid = ~table.isnan().any(dim=0)  # [N] bool
        weights = torch.tensor(self.weights, dtype=torch.float64)  # [F]
        total = (weights[:, None] * table.nan_to_num(0.0)).sum(dim=0)  # [N] float64
        total = torch.where(valid, total, torch.zeros_like(total))
        return RewardResult(
            rewards=total.to(torch.float32),
            valid=valid,
            per_function={name: table[f].to(torch.float32) for f, name in enumerate(self.names)},
            failures=failures,
        )

    def _run_all(self, tasks, prompts, completions, metadata):
        """Run every (fn index, sample index) task; returns ({task: value}, {task: exception}).

        Why threads: reward functions are mostly I/O (HTTP judges) or subprocess waits (the sandbox), which
        release the GIL, and threads can share the unpicklable closures users register. Why not
        ``ThreadPoolExecutor``: a Python thread cannot be killed, and the executor joins its (non-daemon)
        threads at interpreter exit, so one function stuck in ``while True`` would hang the trainer forever.
        Here a call that runs past ``timeout_s`` is recorded as a TimeoutError and *abandoned*: it keeps its
        daemon thread until it returns (or the process exits), its late result is ignored, and a fresh
        worker takes its place. CPU-bound or untrusted code belongs in the sandbox (a killable subprocess).
        """
        todo: queue.SimpleQueue = queue.SimpleQueue()
        for task in tasks:
            todo.put(task)
        events: queue.SimpleQueue = queue.SimpleQueue()  # ("start" | "done", task, payload)

        def worker() -> None:
            while True:
                try:
                    task = todo.get_nowait()
                except queue.Empty:
                    return
                f, i = task
                events.put(("start", task, time.monotonic()))
                try:
                    out: Any = _as_reward_value(self.fns[f](prompts[i], completions[i], metadata[i]))
                except Exception as e:  # any failure of user code masks the sample
                    out = e
                events.put(("done", task, out))

        def spawn() -> None:
            threading.Thread(target=worker, daemon=True, name="orbit-reward").start()

        for _ in range(min(self.max_workers, len(tasks))):
            spawn()
        values: dict[tuple[int, int], float] = {}
        errors: dict[tuple[int, int], BaseException] = {}
        started: dict[tuple[int, int], float] = {}
        while len(values) + len(errors) < len(tasks):
            first_deadline = min(started.values(), default=time.monotonic()) + self.timeout_s
            try:
                kind, task, payload = events.get(timeout=max(first_deadline - time.monotonic(), 0.0))
            except queue.Empty:
                kind = None
            if kind == "start":
                started[task] = payload
            elif kind == "done" and task in started:  # a "done" for a call already timed out is ignored
                del started[task]
                if isinstance(payload, BaseException):
                    errors[task] = payload
                else:
                    values[task] = payload
            now = time.monotonic()
            for task, t0 in list(started.items()):
                if now - t0 >= self.timeout_s:
                    del started[task]
                    errors[task] = TimeoutError(f"no result after {self.timeout_s:g} s; call abandoned")
                    spawn()  # the stuck thread no longer counts as a worker
        return values, errors


def _as_reward_value(value: Any) -> float:
    if not isinstance(value, numbers.Real):  # bool and numpy scalars are Real
        raise TypeError(f"reward returned {type(value).__name__} ({value!r:.80}), expected a real number")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"reward returned non-finite {value}")
    return value
