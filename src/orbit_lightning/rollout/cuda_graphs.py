"""CUDA graphs for decode: one graph per (kind, adapter slot, batch-size bucket, block-table width), captured
lazily. Three kinds (`ModelRunner`):
- "sampled": the whole decode step (forward, lm_head, sampling kernel, log-probs) writing a static [2, b]
  (token, log-prob) buffer, and advancing its own static inputs to the next step, so multi-step decode replays
  it back to back without touching the inputs;
- "steps": the engine's `decode_steps` "sampled" steps in one graph, writing [steps, 2, b]: a full multi-step
  call is one launch (the steps share the static inputs, so the two kinds can take turns);
- "hidden": only the model forward (embeddings, layers, final norm) writing a static [b, D] hidden-state
  buffer, for batches whose sampling cannot be captured (top-k / top-p rows sort on a host-chosen path).

Why the adapter slot is part of the key: LoRA layers choose their tensors (slot0 or slot1) in Python while
capturing, so a graph bakes in one slot's buffer addresses. Staging copies *into* those buffers, so graphs stay
valid across versions; only the slot choice needs its own graph.

Graphs share one memory pool. That is safe because they never run concurrently and each replay's output is
consumed (copied out, or read by lm_head) before the next replay. Padding rows of a bucket decode token 0 at
position 0 into the null block; their outputs are dropped.

MoE layers are captured when their experts run on device groups (quant.grouped.ExpertGroups: every expert in
one grouped call on device offsets, no host sync): packed experts in a format the fused grouped kernel reads,
plain bf16 experts through torch's grouped GEMM on sm90 / sm100; expert LoRA follows its base. During a capture
the packed experts take that path whatever the batch size. In batch-invariant (deterministic) decode only the
packed experts' fused kernel stays invariant without host-read group sizes: expert LoRA and plain experts are
invariant group by group only. Models with experts that need host-read group sizes cannot be captured;
`capture_blocker` names the reason and the engine decodes those eagerly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn


def batch_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16: padding wastes at most ~2x at tiny batches and < 16 rows beyond."""
    small = [b for b in (1, 2, 4, 8) if b < max_batch_size]
    return small + list(range(16, max_batch_size, 16)) + [max_batch_size]


def capture_blocker(model: nn.Module, device: torch.device, deterministic: bool = False) -> str | None:
    """Why decode of `model` on `device` cannot be graph-captured, or None if it can. `deterministic`: decode
    runs in batch-invariant mode, which the captured graph must keep."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device (model is on {device.type})"
    for name, module in model.named_modules():
        check = getattr(module, "device_groups_blocker", None)  # Experts, QuantExperts, LoraExperts
        if check is not None and (reason := check(device, invariant=deterministic)) is not None:
            return f"MoE experts {name} need expert group sizes read on the host (a sync): {reason}"
    return None


class DecodeGraphs:
    def __init__(self, forwards: dict[str, Callable[..., Tensor]], padding: tuple, max_batch_size: int,
                 max_width: int, device: torch.device):
        self.forwards = forwards  # kind -> f(*static inputs) -> static output; "sampled" also advances its inputs
        self.padding = padding  # per input: the value of the rows of a bucket beyond the real batch
        self.buckets = batch_buckets(max_batch_size)
        self.max_width, self.device = max_width, device
        self.pool = torch.cuda.graph_pool_handle()
        # Our own capture stream on our device: torch.cuda.graph's default is one class-wide stream made on
        # whatever device was current at its first use, so an engine on cuda:1 would leave every later capture
        # on cuda:0 recording into a cuda:1 stream (an empty graph).
        self.stream = torch.cuda.Stream(device)
        self._inputs: dict[tuple, tuple[Tensor, ...]] = {}
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, Tensor]] = {}

    @property
    def num_captured(self) -> int:
        return len(self._graphs)

    def fits(self, batch: int, width: int) -> bool:
        return batch <= self.buckets[-1] and width <= self.max_width

    def _bucket(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    def _pad(self, static: tuple[Tensor, ...], start: int) -> None:
        for x, fill in zip(static, self.padding):
            x[start:].fill_(fill)

    def _capture(self, kind: str, static: tuple[Tensor, ...]) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        forward = self.forwards[kind]
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):  # warm up (kernel autotuning, lazy inits) outside the capture
            for _ in range(2):
                self._pad(static, 0)  # a dummy batch: writes hit the null block
                forward(*static)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self._pad(static, 0)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads (the trainer, the async front end) may use CUDA during a capture.
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
            out = forward(*static)
        return graph, out

    def run(self, kind: str, slot: str | None, inputs: tuple[Tensor, ...], stage: bool = True) -> Tensor:
        """Replay the `kind` graph on `inputs` (batch-first tensors; the first n rows of the bucket) -> its
        static output (rows or columns beyond n are padding). stage=False replays on the static inputs as the
        previous replay of this graph left them (a "sampled" graph advanced them to the next step)."""
        n = inputs[0].shape[0]
        shape_key = (self._bucket(n), *(tuple(x.shape[1:]) for x in inputs))
        key = (kind, slot, *shape_key)
        if shape_key not in self._inputs:
            self._inputs[shape_key] = tuple(torch.empty((shape_key[0], *x.shape[1:]), dtype=x.dtype, device=self.device)
                                            for x in inputs)
        static = self._inputs[shape_key]
        if key not in self._graphs:
            self._graphs[key] = self._capture(kind, static)
            stage = True
        if stage:
            for s, x in zip(static, inputs):
                s[:n].copy_(x, non_blocking=True)  # (from pinned host memory: no sync)
            self._pad(static, n)
        graph, out = self._graphs[key]
        graph.replay()
        return out
