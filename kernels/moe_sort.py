"""MoE routing for decode-sized batches in one launch: the (token, slot) pairs sorted by expert, the inverse
permutation, and every expert's row offsets.

torch takes a radix sort (1-2 launches), an arange and a scatter for the inverse, and an index, arange, searchsorted
and cat for the offsets: ~8 launches of ~1.5 us per MoE layer, while a decode step's experts read ~20 us of weights
(bench/RESULTS.md). Here one program sorts the keys expert * N + position (so equal experts keep their order: the
stable argsort, exactly), writes the inverse from the sorted lanes, and takes the offsets from a histogram. For up
to MAX_ROWS pairs (decode sizes, where launches dominate); larger batches keep torch's sort.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .pdl import use_pdl, wait_for_producers

# Pairs one program sorts (a bitonic sort). Larger batches take torch's radix sort: on the H200 (bench/moe_sweeps.py
# --sections sort, cold L2) the kernel took 1.8 / 4.5 / 23.8 / 89 us at 8 / 512 / 2048 / 4096 pairs against torch's
# ops' 20.5 / 46 / 52 / 57 us.
MAX_ROWS = 2048


def sorts(n: int, num_experts: int) -> bool:
    """Whether sort_by_expert takes n pairs of num_experts experts: at most MAX_ROWS, and keys (expert * N + i, N
    the pairs rounded up to a power of two) that fit an int32."""
    return n <= MAX_ROWS and num_experts * triton.next_power_of_2(max(n, 1)) < 2**31


@triton.jit
def _sort_kernel(ids_ptr, order_ptr, inverse_ptr, offsets_ptr, n, num_experts, N_POW2: tl.constexpr,
                 BINS: tl.constexpr, PDL: tl.constexpr):
    wait_for_producers(PDL)
    i = tl.arange(0, N_POW2)
    ok = i < n
    ids = tl.load(ids_ptr + i, mask=ok, other=0).to(tl.int32)
    key = tl.sort(tl.where(ok, ids * N_POW2 + i, 2**31 - 1))  # pads sort last
    order = key % N_POW2
    tl.store(order_ptr + i, order.to(tl.int64), mask=ok)
    tl.store(inverse_ptr + order, i.to(tl.int64), mask=ok)
    # Pads count in the last bin (BINS > num_experts), which no stored offset includes.
    counts = tl.histogram(tl.where(ok, ids, BINS - 1), BINS)
    e = tl.arange(0, BINS)
    tl.store(offsets_ptr + e, tl.cumsum(counts, 0) - counts, mask=e <= num_experts)


def sort_by_expert(expert_ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """expert_ids int [n] (n <= MAX_ROWS), each in [0, num_experts) -> (order int64 [n]: the stable argsort, inverse
    int64 [n]: its inverse permutation, offsets int32 [num_experts + 1]: expert e's rows of the sorted order are
    offsets[e]:offsets[e + 1]). Ids out of range are not checked (that would need a host sync)."""
    n = expert_ids.numel()
    if expert_ids.dim() != 1 or expert_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"sort_by_expert takes int32/int64 [n] expert ids, got {tuple(expert_ids.shape)} "
                         f"{expert_ids.dtype}")
    n_pow2 = triton.next_power_of_2(max(n, 1))
    if not sorts(n, num_experts):
        raise ValueError(f"sort_by_expert sorts at most {MAX_ROWS} rows (keys expert * rows < 2**31), got {n} rows "
                         f"of {num_experts} experts; sort larger batches with torch.argsort")
    device = expert_ids.device
    order = torch.empty(n, dtype=torch.int64, device=device)
    inverse = torch.empty(n, dtype=torch.int64, device=device)
    offsets = torch.empty(num_experts + 1, dtype=torch.int32, device=device)
    pdl = use_pdl(device)
    _sort_kernel[(1,)](expert_ids.contiguous(), order, inverse, offsets, n, num_experts, N_POW2=n_pow2,
                       BINS=triton.next_power_of_2(num_experts + 1), PDL=pdl, launch_pdl=pdl,
                       num_warps=4 if n_pow2 <= 1024 else 8)  # fmt: skip
    return order, inverse, offsets
