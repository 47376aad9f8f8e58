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


def append_tokens(seq: Sequence, tokens: list[int], logprobs: list[float], version: int | None, eos_ids: set[int],
                  max_model_len: int, tokenizer=None) -> None:
    """Append the tokens one decode step sampled for `seq` (several with multi-step decode) up to the first that
    stops it, setting `finish_reason` ("stop" | "length") and `stop_reason` with vLLM's order of checks per token:
    EOS, stop token ids, stop strings, then the length limits. Tokens after the stop are dropped."""
    p = seq.request.params
    eos = () if p.ignore_eos else eos_ids
    stop_ids = p.stop_token_ids or ()
    # The length limits: the `room`-th token (1-based) stops the sequence unless something stops it before.
    room = max_model_len - len(seq.tokens)
    if p.max_new_tokens is not None:
        room = min(room, p.max_new_tokens - (len(seq.tokens) - seq.prompt_len))
    n = min(len(tokens), max(room, 1))
    strings = p.stop_strings if tokenizer is not None else []
    if strings:  # decoded text of the window's tokens (generated ones only), grown by each new token
        longest = max(len(s) for s in strings)
        recent = seq.tokens[max(seq.prompt_len, len(seq.tokens) - _window(longest)):]
        before = tokenizer.decode(recent) if recent else ""
    for i in range(n):
        tok = tokens[i]
        if tok in eos or tok in stop_ids:  # (EOS first: a token that is both gives no stop_reason)
            seq.finish_reason = "stop"
            if tok not in eos:
                seq.stop_reason = tok
            n = i + 1
            break
        if strings:
            recent.append(tok)
            text = tokenizer.decode(recent)
            tail = text[max(0, len(before) - longest + 1):]  # only text that the new token could complete
            hit = next((s for s in strings if s in tail), None)
            before = text
            if hit is not None:
                seq.finish_reason, seq.stop_reason = "stop", hit
                n = i + 1
                break
    else:
        if n >= room:
            seq.finish_reason = "length"
    seq.tokens.extend(tokens[:n])
    seq.logprobs.extend(logprobs[:n])
    seq.versions.extend([version] * n)


# Stop strings are looked for in the text of a window of the last generated tokens, not of the whole generation:
# decoding everything after every token is quadratic (a 512-token sample at batch 64 cost 2.5 ms of host time per
# step, bench/engine_host.py). The window starts _window(longest) tokens before a decode step's first token. A
# token carries at least a quarter of a character (a 4-byte UTF-8 character split into bytes), so it holds every
# character a stop string ending in a new token can span, with room to spare; decoding a suffix of the tokens
# changes at most its first few characters (a partial character, a leading space).
def _window(longest: int) -> int:
    return 4 * longest + 8
