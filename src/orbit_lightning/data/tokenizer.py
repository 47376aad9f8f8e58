"""A character-level tokenizer for the embedded default model: no files to download, a vocab of ~50."""

from __future__ import annotations

import json
import os
import string
from collections.abc import Iterable

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
DEFAULT_CHARS = string.digits + "+-*=() \n" + string.ascii_lowercase
TOKENIZER_FILE = "tokenizer_char.json"


class CharTokenizer:
    """One token per character; ids 0, 1, 2 are ``<pad>``, ``<bos>``, ``<eos>``, then ``chars`` in order.

    Mirrors the parts of the Hugging Face tokenizer interface that the trainer uses.
    """

    pad_token, bos_token, eos_token = SPECIAL_TOKENS
    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2

    def __init__(self, chars: str = DEFAULT_CHARS) -> None:
        if not chars:
            raise ValueError("CharTokenizer needs a non-empty character set")
        repeated = sorted({c for c in chars if chars.count(c) > 1})
        if repeated:
            raise ValueError(f"CharTokenizer character set repeats {repeated!r}; each character once")
        self.chars = chars
        self.special_tokens = SPECIAL_TOKENS
        self._id_of = {c: i + len(SPECIAL_TOKENS) for i, c in enumerate(chars)}
        self._token_of = list(SPECIAL_TOKENS) + list(chars)

    @property
    def vocab_size(self) -> int:
        return len(self._token_of)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = [self.bos_token_id] if add_bos else []
        for pos, c in enumerate(text):
            try:
                ids.append(self._id_of[c])
            except KeyError:
                raise ValueError(
                    f"character {c!r} at position {pos} of {text!r:.60} is not in the tokenizer's character "
                    f"set {self.chars!r}; build CharTokenizer(chars=...) with it"
                ) from None
        if add_eos:
            ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        out = []
        for i in ids:
            i = int(i)  # accepts tensor elements
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
            if i >= len(SPECIAL_TOKENS) or not skip_special_tokens:
                out.append(self._token_of[i])
        return "".join(out)

    def __call__(self, text: str | list[str], add_bos: bool = False, add_eos: bool = False) -> dict:
        """``{"input_ids": ids}`` for one text, or a list of id lists for a list of texts (unpadded)."""
        if isinstance(text, str):
            return {"input_ids": self.encode(text, add_bos, add_eos)}
        return {"input_ids": [self.encode(t, add_bos, add_eos) for t in text]}

    def save_pretrained(self, save_directory: str | os.PathLike) -> str:
        os.makedirs(save_directory, exist_ok=True)
        path = os.path.join(save_directory, TOKENIZER_FILE)
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"type": "char", "special_tokens": list(SPECIAL_TOKENS), "chars": self.chars}, f)
        return path

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> CharTokenizer:
        path = os.path.join(directory, TOKENIZER_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"no {TOKENIZER_FILE} in {os.fspath(directory)!r}; write it with save_pretrained"
            )
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
        if spec.get("type") != "char" or tuple(spec.get("special_tokens", ())) != SPECIAL_TOKENS:
            raise ValueError(f"{path} is not a CharTokenizer file of this version (got {spec!r:.120})")
        return cls(spec["chars"])

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size}, chars={self.chars!r})"
