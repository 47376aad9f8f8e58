import re

import pytest

from orbit_lightning.data import ArithmeticTaskConfig, CharTokenizer, make_arithmetic_split
from orbit_lightning.data.tasks import evaluate


def test_items_are_correct_and_in_range():
    cfg = ArithmeticTaskConfig(
        num_digits_min=2,
        num_digits_max=4,
        ops=("+", "-", "*"),
        num_operands=3,
        seed=1,
        train_size=300,
        eval_size=50,
    )
    train, evals = make_arithmetic_split(cfg)
    assert len(train) == 300 and len(evals) == 50
    tok = CharTokenizer()
    for item in train + evals:
        assert set(item) == {"prompt", "answer"} and item["prompt"].endswith("=")
        expr = item["prompt"][:-1]
        assert item["answer"] == str(eval(expr))  # Python's own precedence rules as the oracle
        operands = re.split(r"[+\-*]", expr)
        assert len(operands) == 3 and all(2 <= len(x) <= 4 and x[0] != "0" for x in operands)
        tok.encode(item["prompt"] + item["answer"])  # every character is in the default vocab


def test_deterministic_and_disjoint():
    cfg = ArithmeticTaskConfig(num_digits_min=1, num_digits_max=2, seed=7, train_size=2000, eval_size=200)
    train, evals = make_arithmetic_split(cfg)
    assert (train, evals) == make_arithmetic_split(cfg)
    prompts = [x["prompt"] for x in train + evals]
    assert len(set(prompts)) == len(prompts)  # unique, so eval and train share no prompt
    assert (
        make_arithmetic_split(ArithmeticTaskConfig(num_digits_max=2, seed=8, train_size=2000, eval_size=200))[
            1
        ]
        != evals
    )
    # eval is drawn first, so it is stable when only train_size changes
    smaller = ArithmeticTaskConfig(num_digits_min=1, num_digits_max=2, seed=7, train_size=10, eval_size=200)
    assert make_arithmetic_split(smaller)[1] == evals


def test_evaluate_precedence():
    assert evaluate([3, 4, 5], ["-", "*"]) == -17
    assert evaluate([2, 3, 4, 5], ["*", "+", "*"]) == 26
    assert evaluate([7, 9], ["-"]) == -2


def test_capacity_and_validation():
    # one-digit operands (0-9), one op, two operands: exactly 100 distinct prompts
    full = ArithmeticTaskConfig(num_digits_min=1, num_digits_max=1, ops=["+"], train_size=90, eval_size=10)
    assert full.ops == ("+",) and full.num_distinct_prompts() == 100
    train, evals = make_arithmetic_split(full)
    assert len({x["prompt"] for x in train + evals}) == 100
    with pytest.raises(ValueError, match="only 100"):
        ArithmeticTaskConfig(num_digits_min=1, num_digits_max=1, ops=("+",), train_size=100, eval_size=1)
    with pytest.raises(ValueError, match="ops"):
        ArithmeticTaskConfig(ops=("/",))
    with pytest.raises(ValueError, match="num_digits"):
        ArithmeticTaskConfig(num_digits_min=3, num_digits_max=2)
