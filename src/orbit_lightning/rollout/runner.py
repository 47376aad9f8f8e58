"""Turns scheduled sequences into model inputs, runs the trainer's forward on them and returns fp32 logits.

The forward is `model.hidden_states(ids, position_ids=..., ctx=PagedAttention)` followed by
`model.lm_head(h).float()`: the same modules, kernels and packed tensors the trainer runs, with only the k/v
storage swapped (see `kv_cache.py`). Decode forwards can replay CUDA graphs (`cuda_graphs.py`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .blocks import NULL_BLOCK, NULL_SLOT
from .cuda_graphs import DecodeGraphs
from .kv_cache import PagedAttention, PagedKVCache


def width_bucket(blocks: int, max_blocks: int) -> int:
    """Block-table width for a decode batch: the next power of two (bounded), so that a CUDA graph can serve
    every step until the longest sequence crosses the bucket, and eager and graph steps gather alike."""
    return min(1 << max(blocks - 1, 0).bit_length(), max_blocks)


class ModelRunner:
    def __init__(self, model: nn.Module, cache: PagedKVCache, max_blocks_per_seq: int,
                 graphs: DecodeGraphs | None):
        self.model, self.cache, self.graphs = model, cache, graphs
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

    @torch.no_grad()
    def decode(self, tokens: list[int], positions: list[int], tables: list[list[int]], graph_key: str | None) -> Tensor:
        """One new token per sequence at `positions` (its k/v slot is reserved) -> logits [B, V] fp32."""
        b = len(tokens)
        w = width_bucket(max(len(t) for t in tables), self.max_blocks_per_seq)
        table = torch.tensor([t + [NULL_BLOCK] * (w - len(t)) for t in tables])
        slots = [self._slot(t, p) for t, p in zip(tables, positions)]
        # One host tensor, one copy to the device: ids, positions, slots, context lengths.
        packed = torch.tensor([tokens, positions, slots, [p + 1 for p in positions]]).to(self.device)
        inputs = (packed[0, :, None], packed[1, :, None], packed[2, :, None], table.to(self.device), packed[3])
        if self.graphs is not None and self.graphs.fits(b, w):
            hidden = self.graphs.run(graph_key, *inputs)
        else:
            hidden = self.decode_hidden(*inputs)
        return self.model.lm_head(hidden).float()

    def decode_hidden(
        self,
        ids: Tensor,  # [B, 1] int64
        positions: Tensor,  # [B, 1] int64
        slots: Tensor,  # [B, 1] int64 flat cache slot of the new token
        block_tables: Tensor,  # [B, W] int64
        context_lens: Tensor,  # [B] int64 = position + 1
    ) -> Tensor:
        """The model forward of one decode step -> final hidden states [B, D]; the region a CUDA graph captures."""
        ctx = PagedAttention.decode(self.cache, slots, block_tables, context_lens)
        return self.model.hidden_states(ids, position_ids=positions, ctx=ctx)[:, 0]
