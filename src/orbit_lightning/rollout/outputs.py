"""What the engine returns: one `RequestOutput` per prompt holding one `CompletionOutput` per sample (vLLM's shape)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int  # sample index j in [0, n)
    token_ids: list[int]  # generated tokens only (the EOS / stop token included)
    # log p(token) under the untempered fp32 distribution of the logits it was sampled from: the quantity the
    # trainer recomputes (`models.logprobs`), not the temperature/top-p/top-k distribution that drew it.
    logprobs: list[float]
    finish_reason: str | None  # "stop" | "length" | "abort"; None while still generating
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it (None for EOS/length)
    adapter_version: int | None = None  # the version that produced the first token (None: model has no adapter)
    adapter_versions: list[int | None] = field(default_factory=list)  # per token; differ only under "switch"
    text: str | None = None  # decoded token_ids once finished, when the engine has a tokenizer

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # empty when `error` is set
    finished: bool
    prompt: str | None = None
    error: str | None = None  # why the request was rejected; the other requests are unaffected
