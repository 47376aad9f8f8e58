"""Turns scheduled sequences into model inputs, runs the trainer's forward on them and samples.

The forward is `model.hidden_states(ids, position_ids=..., ctx=PagedAttention)` followed by
`model.lm_head(h).float()`: the same modules, kernels and packed tensors the trainer runs, with only the k/v
storage swapped (see `kv_cache.py`).

Decode runs `num_steps` tokens per call (multi-step decode): each step feeds the tokens the previous one sampled
straight from the device (`DecodeInputs.advance`), and the host reads every step's tokens and log-probs once at
the end, so the GPU does not idle while Python handles each token. On CUDA with the sampling kernel, one CUDA
graph holds the whole step (forward, lm_head, sampling, log-probs, input advance; `cuda_graphs.py`) and the
host only replays it; a call of the engine's full `decode_steps` replays one graph that holds all of its steps
(one launch, no copy between steps). Rows with top-k / top-p (a host-chosen sort), and the CPU, sample eagerly
after the forward.

The host stages a call's inputs from pinned memory with asynchronous copies and reads its results the same way:
a pageable copy synchronizes the stream, and the GPU idles meanwhile (bench/trace_gaps.py found such copies and
the graph launch behind most of a batch-1 step's idle time).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch
from torch import Tensor, nn

from ..models import invariant
from ..triton_kernels import kernels_module
from .blocks import NULL_BLOCK, NULL_SLOT
from .cuda_graphs import DecodeGraphs
from .kv_cache import PagedAttention, PagedKVCache
from .sampling import RowSampling, sampled_logprobs, sampling_kernel


def width_bucket(blocks: int, max_blocks: int) -> int:
    """Block-table width for a decode batch: the next power of two (bounded), so that a CUDA graph can serve
    every step until the longest sequence crosses the bucket, and eager and graph steps gather alike."""
    return min(1 << max(blocks - 1, 0).bit_length(), max_blocks)


@dataclass
class DecodeInputs:
    """The device tensors of one decode step of B sequences (the static inputs a decode graph reads)."""

    ids: Tensor  # [B, 1] int64 token fed at this step
    positions: Tensor  # [B, 1] int64 its position
    slots: Tensor  # [B, 1] int64 flat cache slot its k/v is written to
    block_tables: Tensor  # [B, W] int64 (NULL_BLOCK padded)
    context_lens: Tensor  # [B] int64 keys attended = position + 1
    temperature: Tensor  # [B] fp32, 0 = greedy
    seeds: Tensor  # [B] int64 sampling seed of the row
    steps: Tensor  # [B] int64 tokens the row generated so far (keys the sampler's noise)

    # What the rows of a graph's batch bucket beyond the real batch hold: token 0 at position 0, writing into
    # the null block, greedy.
    PADDING = (0, 0, NULL_SLOT, NULL_BLOCK, 1, 0.0, 0, 0)

    def tensors(self) -> tuple[Tensor, ...]:
        return tuple(getattr(self, f.name) for f in fields(self))

    def to(self, device: torch.device) -> DecodeInputs:
        return DecodeInputs(*(t.to(device, non_blocking=True) for t in self.tensors()))

    def advance(self, tokens: Tensor, block_size: int) -> None:
        """In place, on the device: the next step feeds `tokens` [B] one position further. The slot is read
        from the block table, which the scheduler filled for every step of the call (the clamp only keeps
        padding rows, whose table is all null blocks, in bounds)."""
        self.ids.copy_(tokens[:, None])
        self.positions += 1
        self.context_lens += 1
        self.steps += 1
        block = (self.positions // block_size).clamp_(max=self.block_tables.shape[1] - 1)
        self.slots.copy_(self.block_tables.gather(1, block) * block_size + self.positions % block_size)


MULTI_STEP_GRAPH = True  # a full call replays one graph of all its steps (False: one replay per step; benchmarks)


class ModelRunner:
    def __init__(self, model: nn.Module, cache: PagedKVCache, max_blocks_per_seq: int,
                 graphs: DecodeGraphs | None, graph_steps: int = 1):
        self.model, self.cache, self.graphs = model, cache, graphs
        self.graph_steps = graph_steps  # decode steps the "steps" graph holds (the engine's decode_steps)
        self.block_size = cache.block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = cache.k.device

    def _slot(self, table: list[int], pos: int) -> int:
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    @torch.no_grad()
    def prefill(self, token_lists: list[list[int]], tables: list[list[int]]) -> Tensor:
        """Compute every token of each sequence (nothing cached yet) -> logits [B, V] fp32 at each last token."""
        b, t = len(token_lists), max(len(x) for x in token_lists)
        pad = [t - len(x) for x in token_lists]
        ids = torch.tensor([x + [0] * n for x, n in zip(token_lists, pad)], device=self.device)
        slots = torch.tensor([[self._slot(table, p) for p in range(len(x))] + [NULL_SLOT] * n
                              for x, table, n in zip(token_lists, tables, pad)], device=self.device)
        valid = torch.arange(t, device=self.device)[None, :] < torch.tensor([len(x) for x in token_lists],
                                                                            device=self.device)[:, None]
        pos = torch.arange(t, device=self.device).expand(b, t)  # right padding: positions start at 0
        ctx = PagedAttention.prefill(self.cache, slots, valid)
        hidden = self.model.hidden_states(ids, position_ids=pos, ctx=ctx)  # [B, T, D]
        last = torch.tensor([len(x) - 1 for x in token_lists], device=self.device)
        return self.model.lm_head(hidden[torch.arange(b, device=self.device), last]).float()

    def decode_inputs(self, tokens: list[int], positions: list[int], tables: list[list[int]],
                      sampling: RowSampling) -> DecodeInputs:
        """The call's inputs on the host (pinned when the device is a GPU, so copies to it need no sync)."""
        w = width_bucket(max(len(t) for t in tables), self.max_blocks_per_seq)
        # (numpy builds these from nested lists ~5x faster than torch.tensor: bench/engine_host.py)
        table = torch.from_numpy(np.array([t + [NULL_BLOCK] * (w - len(t)) for t in tables], dtype=np.int64))
        slots = [self._slot(t, p) for t, p in zip(tables, positions)]
        ints = torch.from_numpy(np.array([tokens, positions, slots, [p + 1 for p in positions], sampling.seeds,
                                          sampling.steps], dtype=np.int64))  # fmt: skip
        temperature = sampling.temperature
        if self.device.type == "cuda":
            table, ints, temperature = table.pin_memory(), ints.pin_memory(), temperature.pin_memory()
        return DecodeInputs(ints[0, :, None], ints[1, :, None], ints[2, :, None], table, ints[3], temperature,
                            ints[4], ints[5])

    def _to_host(self, out: Tensor) -> Tensor:
        """`out` on the host, once the stream has computed it (through pinned memory on a GPU)."""
        if self.device.type != "cuda":
            return out.cpu()
        host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
        host.copy_(out, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        return host

    @torch.no_grad()
    def decode(self, tokens: list[int], positions: list[int], tables: list[list[int]], graph_key: str | None,
               sampling: RowSampling, num_steps: int = 1) -> Tensor:
        """Decode `num_steps` tokens per sequence, from `tokens` at `positions` (their k/v slots for every step
        are reserved in `tables`) -> host fp32 [num_steps, 2, B]: the sampled token ids (exact in fp32 below
        2^24) and their log-probs. The caller drops what a sequence sampled after it stopped."""
        inputs = self.decode_inputs(tokens, positions, tables, sampling)
        b, w = inputs.block_tables.shape
        graphed = self.graphs is not None and self.graphs.fits(b, w)
        if graphed and not sampling.masked and sampling_kernel(self.device) is not None:
            if MULTI_STEP_GRAPH and num_steps == self.graph_steps > 1:
                return self._to_host(self.graphs.run("steps", graph_key, inputs.tensors())[:, :, :b])
            out = torch.empty(num_steps, 2, b, device=self.device)
            for i in range(num_steps):  # replays back to back: the graph advances its own inputs
                out[i] = self.graphs.run("sampled", graph_key, inputs.tensors(), stage=i == 0)[:, :b]
            return self._to_host(out)
        inputs = inputs.to(self.device)
        out = torch.empty(num_steps, 2, b, device=self.device)
        for i in range(num_steps):
            hidden = (self.graphs.run("hidden", graph_key, inputs.tensors())[:b] if graphed
                      else self.decode_hidden(*inputs.tensors()))
            logits = self.model.lm_head(hidden).float()
            tokens_i = sampling.sample(logits)
            out[i, 0], out[i, 1] = tokens_i, sampled_logprobs(logits, tokens_i)
            inputs.advance(tokens_i, self.block_size)
            sampling = sampling.advanced()
        return self._to_host(out)

    def decode_hidden(self, ids: Tensor, positions: Tensor, slots: Tensor, block_tables: Tensor,
                      context_lens: Tensor, *_sampling: Tensor) -> Tensor:
        """The model forward of one decode step (DecodeInputs' fields) -> final hidden states [B, D]."""
        ctx = PagedAttention.decode(self.cache, slots, block_tables, context_lens)
        return self.model.hidden_states(ids, position_ids=positions, ctx=ctx)[:, 0]

    def decode_sampled(self, *fields: Tensor) -> Tensor:
        """One whole decode step on DecodeInputs' fields, advancing them in place -> [2, B] fp32 (token id,
        log-prob): the region a sampled decode graph captures (no host sync, no host-chosen path)."""
        inputs = DecodeInputs(*fields)
        logits = self.model.lm_head(self.decode_hidden(*fields))
        sample = sampling_kernel(self.device)
        if invariant.active():  # the trainer's own logsumexp kernel: the recorded log-probs are its bits
            logits = logits.float()
            tokens = sample(logits, inputs.temperature, inputs.seeds, inputs.steps)
            logprobs = sampled_logprobs(logits, tokens)
        else:  # one pass over the logits draws and scores (fp32 sums in another order than torch's logsumexp)
            tokens, logprobs = sample(logits, inputs.temperature, inputs.seeds, inputs.steps, logprobs=True)
        # DecodeInputs.advance and the [2, B] record in one launch (kernels/decode_advance.py)
        return kernels_module().advance_decode(tokens, logprobs, inputs.ids, inputs.positions, inputs.slots,
                                               inputs.block_tables, inputs.context_lens, inputs.steps,
                                               self.block_size)  # fmt: skip

    def decode_sampled_steps(self, *fields: Tensor) -> Tensor:
        """`graph_steps` decode_sampled steps back to back -> [graph_steps, 2, B]: the "steps" graph's region."""
        return torch.stack([self.decode_sampled(*fields) for _ in range(self.graph_steps)])
