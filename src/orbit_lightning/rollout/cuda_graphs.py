"""CUDA graphs for decode: one graph per (adapter slot, batch-size bucket, block-table width), captured lazily.

Only the model forward (`ModelRunner.decode_hidden`: embeddings, layers, final norm) is captured; it reads
static input buffers and writes a static [b, D] hidden-state buffer. lm_head, the fp32 cast and sampling run
eagerly after each replay, so no graph holds a [b, V] logits buffer.

Why the adapter slot is part of the key: LoRA layers choose their tensors (slot0 or slot1) in Python while
capturing, so a graph bakes in one slot's buffer addresses. Staging copies *into* those buffers, so graphs stay
valid across versions; only the slot choice needs its own graph.

Graphs share one memory pool. That is safe because they never run concurrently and each replay's output is
consumed (lm_head) before the next replay. Padding rows of a bucket decode token 0 at position 0 into the null
block; their outputs are dropped.

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

from .blocks import NULL_BLOCK, NULL_SLOT


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
    def __init__(self, forward: Callable[..., Tensor], max_batch_size: int, max_width: int, device: torch.device):
        self.forward = forward  # (ids, positions, slots, block_tables, context_lens) -> hidden [b, D]
        self.buckets = batch_buckets(max_batch_size)
        self.max_width, self.device = max_width, device
        self.pool = torch.cuda.graph_pool_handle()
        # Our own capture stream on our device: torch.cuda.graph's default is one class-wide stream made on
        # whatever device was current at its first use, so an engine on cuda:1 would leave every later capture
        # on cuda:0 recording into a cuda:1 stream (an empty graph).
        self.stream = torch.cuda.Stream(device)
        self._inputs: dict[tuple[int, int], tuple[Tensor, ...]] = {}
        self._graphs: dict[tuple[str | None, int, int], tuple[torch.cuda.CUDAGraph, Tensor]] = {}

    @property
    def num_captured(self) -> int:
        return len(self._graphs)

    def fits(self, batch: int, width: int) -> bool:
        return batch <= self.buckets[-1] and width <= self.max_width

    def _bucket(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    def _static_inputs(self, b: int, w: int) -> tuple[Tensor, ...]:
        if (b, w) not in self._inputs:
            z = dict(dtype=torch.long, device=self.device)
            self._inputs[(b, w)] = (
                torch.zeros(b, 1, **z),
                torch.zeros(b, 1, **z),
                torch.full((b, 1), NULL_SLOT, **z),
                torch.full((b, w), NULL_BLOCK, **z),
                torch.ones(b, **z),
            )
        return self._inputs[(b, w)]

    def _capture(self, key: tuple[str | None, int, int]) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        _, b, w = key
        static = self._static_inputs(b, w)
        for x, fill in zip(static, (0, 0, NULL_SLOT, NULL_BLOCK, 1)):  # a dummy batch: writes hit the null block
            x.fill_(fill)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):  # warm up (kernel autotuning, lazy inits) outside the capture
            for _ in range(2):
                self.forward(*static)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads (the trainer, the async front end) may use CUDA during a capture.
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
            out = self.forward(*static)
        return graph, out

    def run(
        self,
        slot: str | None,
        ids: Tensor,
        positions: Tensor,
        slots: Tensor,
        block_tables: Tensor,
        context_lens: Tensor,
    ) -> Tensor:
        """Same arguments and result as the eager forward; rows beyond the real batch are padding."""
        n, w = block_tables.shape
        key = (slot, self._bucket(n), w)
        if key not in self._graphs:
            self._graphs[key] = self._capture(key)
        graph, out = self._graphs[key]
        s_ids, s_pos, s_slots, s_tables, s_ctx = self._static_inputs(key[1], w)
        s_ids[:n].copy_(ids)
        s_pos[:n].copy_(positions)
        s_slots[:n].copy_(slots)
        s_tables[:n].copy_(block_tables)
        s_ctx[:n].copy_(context_lens)
        if n < key[1]:
            s_ids[n:].zero_()
            s_pos[n:].zero_()
            s_slots[n:].fill_(NULL_SLOT)
            s_tables[n:].fill_(NULL_BLOCK)
            s_ctx[n:].fill_(1)
        graph.replay()
        return out[:n]
