"""The built-in verifiable task: procedurally generated multi-digit arithmetic, e.g. "37+485=" -> "522"."""

from __future__ import annotations

import random
from dataclasses import dataclass

SUPPORTED_OPS = ("+", "-", "*")


@dataclass(frozen=True)
class ArithmeticTaskConfig:
    num_digits_min: int = 1
    num_digits_max: int = 3
    ops: tuple[str, ...] = ("+", "-")
    num_operands: int = 2
    seed: int = 0
    train_size: int = 10_000
    eval_size: int = 500

    def __post_init__(self) -> None:
        # Hydra hands lists over; a tuple keeps the config hashable and immutable.
        object.__setattr__(self, "ops", tuple(self.ops))
        if not 1 <= self.num_digits_min <= self.num_digits_max:
            raise ValueError(
                f"need 1 <= num_digits_min <= num_digits_max, got {self.num_digits_min}/{self.num_digits_max}"
            )
        bad = [op for op in self.ops if op not in SUPPORTED_OPS]
        if bad or not self.ops:
            raise ValueError(f"ops must be a non-empty subset of {SUPPORTED_OPS}, got {self.ops!r}")
        if self.num_operands < 2:
            raise ValueError(f"num_operands must be >= 2, got {self.num_operands}")
        if self.train_size < 0 or self.eval_size < 0:
            raise ValueError(f"train_size, eval_size must be >= 0, got {self.train_size}, {self.eval_size}")
        wanted, possible = self.train_size + self.eval_size, self.num_distinct_prompts()
        if wanted > possible:
            raise ValueError(
                f"asked for {wanted} distinct prompts but these settings allow only {possible}; "
                "lower train_size/eval_size or allow more digits, operands or ops"
            )

    def num_distinct_prompts(self) -> int:
        # 1-digit operands include 0: 10 values; d >= 2 digits: 9 * 10**(d-1) values.
        lo = 10 ** (self.num_digits_min - 1) if self.num_digits_min > 1 else 0
        operands = 10**self.num_digits_max - lo
        return operands**self.num_operands * len(set(self.ops)) ** (self.num_operands - 1)


def evaluate(operands: list[int], ops: list[str]) -> int:
    """Value of ``operands[0] ops[0] operands[1] ...`` with ``*`` binding tighter than ``+``/``-``."""
    terms, signs = [operands[0]], [1]
    for op, x in zip(ops, operands[1:]):
        if op == "*":
            terms[-1] *= x
        else:
            terms.append(x)
            signs.append(1 if op == "+" else -1)
    return sum(s * t for s, t in zip(signs, terms))


def _sample(rng: random.Random, cfg: ArithmeticTaskConfig) -> dict[str, str]:
    operands = []
    for _ in range(cfg.num_operands):
        # Pick the digit count first so short and long operands are equally common.
        d = rng.randint(cfg.num_digits_min, cfg.num_digits_max)
        operands.append(rng.randint(0 if d == 1 else 10 ** (d - 1), 10**d - 1))
    ops = [rng.choice(cfg.ops) for _ in range(cfg.num_operands - 1)]
    prompt = str(operands[0]) + "".join(op + str(x) for op, x in zip(ops, operands[1:])) + "="
    return {"prompt": prompt, "answer": str(evaluate(operands, ops))}


def make_arithmetic_split(cfg: ArithmeticTaskConfig) -> tuple[list[dict], list[dict]]:
    """``(train, eval)`` lists of ``{"prompt": "37+485=", "answer": "522"}``, deterministic in ``cfg.seed``.

    All prompts are distinct, so no eval prompt appears in train. Eval is drawn first: its items do not
    change when only ``train_size`` changes.
    """
    rng = random.Random(cfg.seed)
    seen: set[str] = set()
    items: list[dict] = []
    while len(items) < cfg.eval_size + cfg.train_size:
        item = _sample(rng, cfg)
        if item["prompt"] not in seen:
            seen.add(item["prompt"])
            items.append(item)
    return items[cfg.eval_size :], items[: cfg.eval_size]
