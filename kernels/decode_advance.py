"""The end of a graphed decode step in one launch: record the sampled token and its log-prob, and move the
step's inputs one position on (the rollout engine's `DecodeInputs.advance`, which is ~12 torch launches).

At batch 1 a Qwen3-8B decode step is ~1 ms, and after the lm_head GEMV its tail of tiny launches took ~75 us
(bench/trace_gaps.py); each costs its launch, not its bytes. (Measured after: the 8-layer batch-1 step stayed at
1.02 ms, within run-to-run spread; bench/RESULTS.md.) Per row r, in place:
ids[r] = token, positions[r] += 1, context_lens[r] += 1, steps[r] += 1,
slots[r] = table[r, min(pos // page, W - 1)] * page + pos % page (the clamp keeps padding rows, whose table is
all null blocks, in bounds), and out[0, r] = float(token), out[1, r] = log-prob.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .pdl import use_pdl, wait_for_producers

_ROWS = 1024  # rows per program


@triton.jit
def _advance_kernel(tok_ptr, lp_ptr, ids_ptr, pos_ptr, slot_ptr, table_ptr, ctx_ptr, steps_ptr, out_ptr, B, W,
                    stride_table, page, ROWS: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    wait_for_producers(PDL)
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = r < B
    tok = tl.load(tok_ptr + r, mask=ok, other=0)
    pos = tl.load(pos_ptr + r, mask=ok, other=0) + 1
    tl.store(ids_ptr + r, tok, mask=ok)
    tl.store(pos_ptr + r, pos, mask=ok)
    tl.store(ctx_ptr + r, tl.load(ctx_ptr + r, mask=ok, other=0) + 1, mask=ok)
    tl.store(steps_ptr + r, tl.load(steps_ptr + r, mask=ok, other=0) + 1, mask=ok)
    block = tl.minimum(pos // page, W - 1)
    table = tl.load(table_ptr + r.to(tl.int64) * stride_table + block, mask=ok, other=0)
    tl.store(slot_ptr + r, table * page + pos % page, mask=ok)
    tl.store(out_ptr + r, tok.to(tl.float32), mask=ok)
    tl.store(out_ptr + B + r, tl.load(lp_ptr + r, mask=ok, other=0.0), mask=ok)


def advance_decode(tokens: Tensor, logprobs: Tensor, ids: Tensor, positions: Tensor, slots: Tensor,
                   block_tables: Tensor, context_lens: Tensor, steps: Tensor, page: int) -> Tensor:
    """tokens [B] int64 and logprobs [B] fp32 of this step; the step's inputs, updated in place: ids, positions,
    slots ([B, 1] int64), block_tables [B, W] int64, context_lens, steps ([B] int64); page: tokens per cache
    block. -> [2, B] fp32 (token id, exact below 2^24; log-prob)."""
    b, w = block_tables.shape
    for name, t in (("tokens", tokens), ("ids", ids), ("positions", positions), ("slots", slots),
                    ("context_lens", context_lens), ("steps", steps), ("block_tables", block_tables)):
        if t.dtype != torch.int64 or t.shape[0] != b or t.numel() != (b * w if name == "block_tables" else b):
            raise ValueError(f"advance_decode: {name} must be int64 with {b} rows, got {t.dtype} {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"advance_decode: {name} must be contiguous")
    if logprobs.shape != (b,) or logprobs.dtype != torch.float32:
        raise ValueError(f"advance_decode: logprobs must be fp32 [{b}], got {logprobs.dtype} {tuple(logprobs.shape)}")
    out = torch.empty((2, b), dtype=torch.float32, device=tokens.device)
    if b == 0:
        return out
    pdl = use_pdl(tokens.device)
    _advance_kernel[(triton.cdiv(b, _ROWS),)](tokens, logprobs, ids, positions, slots, block_tables, context_lens,
                                              steps, out, b, w, block_tables.stride(0), page,
                                              ROWS=min(_ROWS, triton.next_power_of_2(b)), PDL=pdl, launch_pdl=pdl,
                                              num_warps=4)  # fmt: skip
    return out
