from fractions import Fraction

import pytest

from orbit_lightning.rewards import (
    answers_match,
    extract_answer,
    format_reward,
    get_reward,
    math_exact_reward,
    parse_number,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so \boxed{1} then \boxed{\frac{3}{4}}.", r"\frac{3}{4}"),  # the last box, nested braces
        (r"\boxed{ {a}+{b} }", "{a}+{b}"),
        (r"first \boxed{7} then a broken \boxed{8", "7"),  # an unbalanced box is skipped
        ("<answer> 42 </answer>", "42"),
        ("<answer>1</answer> no, <answer>2</answer>", "2"),
        ("we get 10-3 = 7, total 1,234.5 apples", "1,234.5"),
        ("it is 3/4 of it", "3/4"),
        ("x = -12.", "-12"),
        ("5-8=-3", "-3"),
        ("no digits here", None),
    ],
)
def test_extract_answer_auto(text, expected):
    assert extract_answer(text) == expected


def test_extract_answer_order_and_methods():
    text = r"<answer>5</answer> and \boxed{6} and then 7"
    assert extract_answer(text) == "6"
    assert extract_answer(text, ("answer_tag", "boxed")) == "5"
    assert extract_answer(text, "last_number") == "7"
    assert extract_answer("just 7", ("boxed", "answer_tag")) is None
    with pytest.raises(ValueError, match="choose from"):
        extract_answer(text, "regex")


@pytest.mark.parametrize(
    ("answer", "value"),
    [
        ("42", Fraction(42)),
        ("-7", Fraction(-7)),
        ("$1,234,567$", Fraction(1234567)),
        ("0.75", Fraction(3, 4)),
        (".5", Fraction(1, 2)),
        ("3/4", Fraction(3, 4)),
        (r"\frac{3}{4}", Fraction(3, 4)),
        (r"-\dfrac{6}{8}", Fraction(-3, 4)),
        (r"\frac{-1}{0.5}", Fraction(-2)),
        ("12.", Fraction(12)),
        ("1/0", None),
        ("inf", None),
        ("1e5", None),
        ("x+1", None),
    ],
)
def test_parse_number(answer, value):
    assert parse_number(answer) == value


def test_answers_match_numeric_and_string():
    assert answers_match("0.75", r"\frac{3}{4}")
    assert answers_match("1,000", 1000)
    assert answers_match("2.50", "5/2")
    # exact: floats would call these equal (both round to the same double)
    assert not answers_match("0.1000000000000000000001", "0.1")
    assert answers_match("$x + 1$", "x+1")  # non-numbers: normalised string equality
    assert not answers_match("x+2", "x+1")
    assert not answers_match(None, "1")


def test_math_exact():
    math_exact = get_reward("math_exact")
    meta = {"answer": "3/4"}
    assert math_exact("q", r"thus \boxed{0.75}", meta) == 1.0
    assert math_exact("q", "<answer>\\frac{3}{4}</answer>", meta) == 1.0
    assert math_exact("q", "the answer is 0.75.", meta) == 1.0  # last-number fallback
    assert math_exact("q", r"\boxed{0.7}", meta) == 0.0
    assert math_exact("q", "no answer", meta) == 0.0
    boxed_only = math_exact_reward("boxed")
    assert boxed_only("q", "the answer is 0.75", meta) == 0.0
    # per-sample override through metadata
    assert math_exact("q", "0.75", {"answer": "3/4", "answer_format": "boxed"}) == 0.0
    with pytest.raises(KeyError, match="answer"):
        math_exact("q", r"\boxed{1}", {})


def test_format_reward():
    fmt = get_reward("format")
    assert fmt("q", r"... \boxed{12}", {}) == 1.0
    assert fmt("q", "<answer>12</answer>", {}) == 1.0
    assert fmt("q", "12", {}) == 0.0
    assert format_reward("answer_tag")("q", r"\boxed{12}", {}) == 0.0
    assert fmt("q", r"\boxed{12}", {"answer_format": "answer_tag"}) == 0.0


def test_arithmetic_exact():
    arith = get_reward("arithmetic_exact")
    meta = {"answer": "-448"}
    assert arith("37-485=", "-448", meta) == 1.0
    assert arith("37-485=", " -448\n37+1=38", meta) == 1.0  # cut at the first newline
    assert arith("37-485=", "-448<eos><pad><pad>", meta) == 1.0  # or at the EOS text
    assert arith("37-485=", "-4480", meta) == 0.0
    assert arith("37-485=", "448", meta) == 0.0
    assert arith("37-485=", "", meta) == 0.0
