"""Math verifiers: answer extraction, exact numeric comparison, and the built-in math rewards.

Numbers are compared as ``fractions.Fraction`` so that "0.75", "3/4" and "\\frac{3}{4}" are equal exactly,
with no float rounding deciding a reward.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from orbit_lightning.rewards.base import RewardFn, register_reward

EXTRACTORS = ("boxed", "answer_tag", "last_number")
DEFAULT_EXTRACT = EXTRACTORS
DEFAULT_FORMAT = ("boxed", "answer_tag")
# Where a synthetic-task completion ends: the tokenizer's EOS text (if not skipped at decode) or a newline.
EOS_MARKERS = ("<eos>", "\n")

_BOXED = re.compile(r"\\boxed\s*\{")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# A minus sign only when it is not a binary operator ("10-3" ends in 3, not -3).
_NUMBER = re.compile(r"(?:(?<![\w)])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?|(?<![\w)])-?\.\d+")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_FRAC = re.compile(r"^(-?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")


def _last_boxed(text: str) -> str | None:
    """Contents of the last ``\\boxed{...}`` whose braces balance (nested braces allowed)."""
    for match in reversed(list(_BOXED.finditer(text))):
        depth = 1
        for j in range(match.end(), len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[match.end() : j].strip()
    return None


def _last_answer_tag(text: str) -> str | None:
    found = _ANSWER_TAG.findall(text)
    return found[-1].strip() if found else None


def _last_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return found[-1] if found else None


_EXTRACT = {"boxed": _last_boxed, "answer_tag": _last_answer_tag, "last_number": _last_number}


def _check_methods(methods: str | Sequence[str]) -> tuple[str, ...]:
    methods = (methods,) if isinstance(methods, str) else tuple(methods)
    unknown = [m for m in methods if m not in _EXTRACT]
    if unknown or not methods:
        raise ValueError(
            f"unknown answer extraction method(s) {unknown or methods}; choose from {EXTRACTORS}"
        )
    return methods


def extract_answer(text: str, methods: str | Sequence[str] = DEFAULT_EXTRACT) -> str | None:
    """The answer in ``text`` from the first method that finds one, in the order given; None if none does."""
    for method in _check_methods(methods):
        found = _EXTRACT[method](text)
        if found is not None:
            return found
    return None


def normalize_answer(answer: str) -> str:
    """Strip spacing, ``$``, ``\\left``/``\\right``, a trailing period and thousands separators."""
    s = answer.strip().replace("$", "")
    for noise in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\ "):
        s = s.replace(noise, "")
    s = re.sub(r"\s+", "", s).rstrip(".")
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    return s


def parse_number(answer: str) -> Fraction | None:
    """The exact value of an integer, decimal, ``a/b`` or ``\\frac{a}{b}`` answer; None if it is not one."""
    s = normalize_answer(answer)
    frac = _FRAC.match(s)
    if frac:
        num, den = parse_number(frac.group(2)), parse_number(frac.group(3))
        if num is None or den is None or den == 0:
            return None
        return -(num / den) if frac.group(1) else num / den
    if not re.fullmatch(r"-?(?:\d+/\d+|\d+(?:\.\d*)?|\.\d+)", s):
        return None  # keeps Fraction from accepting "inf", "1e5", "nan" or "1_000"
    try:
        return Fraction(s)
    except ZeroDivisionError:
        return None


def answers_match(predicted: str | None, reference: Any) -> bool:
    """Numeric equality when both sides are numbers, else equality of the normalised strings."""
    if predicted is None or reference is None:
        return False
    reference = str(reference)
    a, b = parse_number(predicted), parse_number(reference)
    if a is not None and b is not None:
        return a == b
    return normalize_answer(predicted) == normalize_answer(reference)


def _methods_for(metadata: dict[str, Any], default: tuple[str, ...]) -> tuple[str, ...]:
    """Per-sample override: ``metadata["answer_format"]`` is a method name or a list of them."""
    return _check_methods(metadata["answer_format"]) if "answer_format" in metadata else default


def _reference(metadata: dict[str, Any]) -> str:
    if metadata.get("answer") is None:
        raise KeyError(f"the reward needs metadata['answer']; got metadata keys {sorted(metadata)}")
    return str(metadata["answer"])


def math_exact_reward(methods: str | Sequence[str] = DEFAULT_EXTRACT) -> RewardFn:
    """Factory: 1.0 if the answer extracted with ``methods`` equals ``metadata["answer"]``, else 0.0."""
    default = _check_methods(methods)

    def math_exact(prompt: str, completion: str, metadata: dict[str, Any]) -> float:
        reference = _reference(metadata)
        predicted = extract_answer(completion, _methods_for(metadata, default))
        return float(answers_match(predicted, reference))

    return math_exact


def format_reward(methods: str | Sequence[str] = DEFAULT_FORMAT) -> RewardFn:
    """Factory: 1.0 if the completion states an answer in one of the formats ``methods``, else 0.0."""
    default = _check_methods(methods)

    def format_ok(prompt: str, completion: str, metadata: dict[str, Any]) -> float:
        return float(extract_answer(completion, _methods_for(metadata, default)) is not None)

    return format_ok


def arithmetic_exact_reward(eos_markers: Sequence[str] = EOS_MARKERS) -> RewardFn:
    """Factory: 1.0 if the completion, cut at the first EOS marker, is exactly the answer string."""

    def arithmetic_exact(prompt: str, completion: str, metadata: dict[str, Any]) -> float:
        end = min((completion.find(m) for m in eos_markers if m in completion), default=len(completion))
        return float(completion[:end].strip() == _reference(metadata).strip())

    return arithmetic_exact


register_reward("math_exact")(math_exact_reward())
register_reward("format")(format_reward())
register_reward("arithmetic_exact")(arithmetic_exact_reward())
