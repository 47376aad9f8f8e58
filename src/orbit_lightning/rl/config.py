"""Configs owned by the RL module: optimizer and how rollouts are sampled."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class OptimConfig:
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0  # optimizer steps of linear warm-up
    schedule: str = "constant"  # constant | cosine (over the run's optimizer steps)

    def validate(self) -> None:
        if self.schedule not in ("constant", "cosine"):
            raise ValueError(f"optim.schedule={self.schedule!r} must be 'constant' or 'cosine'")
        if self.lr <= 0:
            raise ValueError(f"optim.lr must be > 0, got {self.lr}")


@dataclass
class RolloutConfig:
    group_size: int = 8  # G samples per prompt
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    ignore_eos: bool = False
    kv_budget_bytes: int | None = None
    kv_fraction: float | None = None  # of free device memory, when no byte budget is given
    block_size: int = 16
    max_batch_size: int = 256
    cuda_graphs: bool = True
    deterministic: bool = False  # batch-invariant kernels: engine log-probs == trainer log-probs bit for bit
    decode_steps: int | None = None  # tokens per sequence per engine step (multi-step decode); None: 8 on CUDA, else 1
    eval_k: int = 8  # samples per eval prompt for pass@k
    eval_temperature: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)

    def validate(self) -> None:
        if self.group_size < 2:
            raise ValueError(f"rollout.group_size must be >= 2 for group-relative advantages, got {self.group_size}")
        if self.max_new_tokens < 1:
            raise ValueError(f"rollout.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        # The engine checks each request's sampling with these rules (SamplingParams.problem), but only when it
        # takes the request: a bad value here would fail every prompt of the run, so refuse it at startup.
        from ..rollout.params import SamplingParams

        for key, temperature in (("temperature", self.temperature), ("eval_temperature", self.eval_temperature)):
            problem = SamplingParams(temperature=temperature, top_p=self.top_p, top_k=self.top_k,
                                     stop_token_ids=list(self.stop_token_ids)).problem(has_tokenizer=False)
            if problem:  # (its messages start with SamplingParams' field name)
                raise ValueError("rollout." + (key + problem.removeprefix("temperature")
                                               if problem.startswith("temperature") else problem))
        if self.decode_steps is not None and self.decode_steps < 1:
            raise ValueError(f"rollout.decode_steps must be >= 1 (or null for the device default), got "
                             f"{self.decode_steps}")
