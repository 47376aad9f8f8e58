"""Engine-side state of a request and of each of its samples (a `Sequence`), and the stop checks."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .outputs import CompletionOutput, RequestOutput
from .params import SamplingParams


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int  # admission order: lower = older = scheduled first, preempted last
    prompt: str | None = None
    error: str | None = None
    samples: list[Sequence] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.error is not None or all(s.finish_reason is not None for s in self.samples)

    def output(self, tokenizer=None) -> RequestOutput:
        return RequestOutput(self.request_id, list(self.prompt_token_ids),
                             [] if self.error else [s.output(tokenizer) for s in self.samples],
                             self.finished, self.prompt, self.error)


@dataclass(eq=False)
class Sequence:
    request: Request
    index: int  # sample index within the request
    generator: torch.Generator | None  # None for greedy requests
    tokens: list[int]  # prompt + generated
    num_cached: int = 0  # tokens whose k/v are in the cache; 0 after a preemption (recompute)
    block_table: list[int] = field(default_factory=list)
    slot: str | None = None  # adapter slot it decodes with; None before it starts (or without an adapter)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text_checked: int = 0  # generated text length already searched for stop strings

    @property
    def priority(self) -> tuple[int, int]:
        return self.request.arrival, self.index

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def started(self) -> bool:
        """True once it has generated a token: it then belongs to an adapter version."""
        return len(self.tokens) > self.prompt_len

    def output(self, tokenizer=None) -> CompletionOutput:
        gen = self.generated
        return CompletionOutput(self.index, gen, list(self.logprobs), self.finish_reason, self.stop_reason,
                                self.versions[0] if self.versions else None, list(self.versions),
                                tokenizer.decode(gen) if tokenizer is not None and self.finish_reason else None)


def check_stop(seq: Sequence, eos_ids: set[int], max_model_len: int, tokenizer=None) -> None:
    """Set `seq.finish_reason` ("stop" | "length") after a token was appended; vLLM's order of checks."""
    p = seq.request.params
    tok = seq.tokens[-1]
    if not p.ignore_eos and tok in eos_ids:
        seq.finish_reason = "stop"
        return
    if p.stop_token_ids and tok in p.stop_token_ids:
        seq.finish_reason, seq.stop_reason = "stop", tok
        return
    if p.stop_strings and tokenizer is not None:
        text = tokenizer.decode(seq.generated)
        longest = max(len(s) for s in p.stop_strings)
        window = text[max(0, seq.text_checked - longest + 1):]  # only text that the new token could complete
        seq.text_checked = len(text)
        for s in p.stop_strings:
            if s in window:
                seq.finish_reason, seq.stop_reason = "stop", s
                return
    n_gen = len(seq.tokens) - seq.prompt_len
    if (p.max_new_tokens is not None and n_gen >= p.max_new_tokens) or len(seq.tokens) >= max_model_len:
        seq.finish_reason = "length"
