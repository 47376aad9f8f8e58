"""Prompt datasets: load rows from a list, JSON/JSONL or a saved HF dataset, and tokenize the prompts."""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Sequence
from typing import Any

from torch.utils.data import Dataset

from orbit_lightning.data.tokenizer import CharTokenizer

logger = logging.getLogger(__name__)

Source = str | os.PathLike | Sequence[dict[str, Any]]


def load_rows(source: Source, split: str | None = None) -> list[dict[str, Any]]:
    """Rows of ``source``: a list of dicts, a ``.jsonl`` file, a ``.json`` list file, or a directory written
    by ``datasets``' ``save_to_disk`` (``split`` picks one split of a ``DatasetDict``)."""
    if not isinstance(source, str | os.PathLike):
        rows = list(source)
    elif not os.path.exists(source):
        raise FileNotFoundError(f"prompt source {os.fspath(source)!r} does not exist")
    elif os.path.isdir(source):
        rows = _load_hf_dir(os.fspath(source), split)
    elif (path := os.fspath(source)).endswith(".jsonl"):
        rows = []
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path} line {lineno} is not valid JSON: {e}") from None
    elif path.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            rows = json.load(f)
        if not isinstance(rows, list):
            raise ValueError(f"{path} must hold a JSON list of objects, got {type(rows).__name__}")
    else:
        raise ValueError(
            f"cannot read prompts from {path!r}: use a .jsonl file, a .json list file, "
            "or a directory saved with datasets' save_to_disk"
        )
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise TypeError(f"row {i} of {_describe(source)} is a {type(row).__name__}, expected a dict")
    return rows


def _load_hf_dir(path: str, split: str | None) -> list[dict[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise ImportError(
            f"{path!r} is a directory, read as a Hugging Face dataset saved with save_to_disk; "
            "that needs the `datasets` package: pip install datasets"
        ) from None
    loaded = datasets.load_from_disk(path)
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ValueError(
                f"{path!r} holds splits {sorted(loaded)}; pass split= one of them, not {split!r}"
            )
        loaded = loaded[split]
    return list(loaded)


def _describe(source: Source) -> str:
    return repr(os.fspath(source)) if isinstance(source, str | os.PathLike) else "the given list"


def encode_prompt(tokenizer: Any, prompt: str | list[dict[str, str]]) -> tuple[str, list[int]]:
    """``(text, ids)`` of a prompt as the policy will see it.

    With a chat template, the prompt (a string, or a list of chat messages) is rendered as a user turn
    followed by the assistant header. The template writes its own special tokens, so none are added on
    top. Without one, the raw text is encoded (with ``<bos>`` for CharTokenizer).
    """
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not isinstance(prompt, str):
        raise TypeError("a prompt given as chat messages needs a tokenizer with a chat_template")
    if isinstance(tokenizer, CharTokenizer):
        return prompt, tokenizer.encode(prompt, add_bos=True)
    return prompt, list(tokenizer(prompt)["input_ids"])


class PromptDataset(Dataset):
    """Tokenized prompts. Item ``i`` is ``{"prompt_ids", "prompt", "answer", "metadata", "index"}``.

    ``prompt`` is the text fed to the model (after any chat template); ``answer`` is the row's
    ``answer_key`` as a string (None if absent); ``metadata`` is the row without the prompt, with the answer
    also under ``"answer"`` for the built-in rewards; ``index`` is the row's position in the source.
    Prompts longer than ``max_prompt_tokens`` are dropped.
    """

    def __init__(
        self,
        source: Source,
        tokenizer: Any,
        max_prompt_tokens: int | None = None,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        split: str | None = None,
    ) -> None:
        rows = load_rows(source, split)
        if not rows:
            raise ValueError(f"prompt source {_describe(source)} is empty")
        self.items: list[dict[str, Any]] = []
        too_long = 0
        for index, row in enumerate(rows):
            if prompt_key not in row:
                raise KeyError(
                    f"row {index} of {_describe(source)} has no {prompt_key!r} field (has {sorted(row)}); "
                    "set prompt_key to the field holding the prompt"
                )
            text, ids = encode_prompt(tokenizer, row[prompt_key])
            if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
                too_long += 1
                continue
            answer = None if row.get(answer_key) is None else str(row[answer_key])
            metadata = {k: v for k, v in row.items() if k != prompt_key}
            metadata["answer"] = answer
            self.items.append(
                {"prompt_ids": ids, "prompt": text, "answer": answer, "metadata": metadata, "index": index}
            )
        self.dropped = too_long
        if too_long:
            logger.warning(
                "dropped %d of %d prompts from %s: longer than max_prompt_tokens=%d",
                too_long,
                len(rows),
                _describe(source),
                max_prompt_tokens,
            )
        if not self.items:
            raise ValueError(
                f"all {len(rows)} prompts of {_describe(source)} are longer than "
                f"max_prompt_tokens={max_prompt_tokens}; raise the limit"
            )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.items[i]


def train_eval_split(
    items: Sequence[Any], eval_fraction: float | None = None, eval_size: int | None = None, seed: int = 0
) -> tuple[list[Any], list[Any]]:
    """Shuffle ``items`` with ``seed`` and split off ``eval_size`` items (or ``eval_fraction`` of them)."""
    if (eval_fraction is None) == (eval_size is None):
        raise ValueError("give exactly one of eval_fraction and eval_size")
    if eval_fraction is not None:
        if not 0 < eval_fraction < 1:
            raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
        eval_size = max(1, round(len(items) * eval_fraction))
    if not 0 < eval_size < len(items):
        raise ValueError(f"eval_size={eval_size} must leave both splits non-empty for {len(items)} items")
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    return [items[i] for i in order[eval_size:]], [items[i] for i in order[:eval_size]]
