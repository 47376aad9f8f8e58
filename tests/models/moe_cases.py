"""Shared MoE test cases: tiny random experts, routings with empty experts / one token / top-k > 1, and a switch
between the two dispatch paths (device groups vs host-sized chunks)."""

from __future__ import annotations

import contextlib

import torch

from orbit_lightning.models.moe import Experts

E, D, I = 8, 64, 32  # experts, hidden, intermediate: 16-byte rows in fp32 and bf16

# name -> (topk ids [T, k]): experts 1, 2, 4 and 6 never get a row in "empty-experts".
ROUTINGS = {
    "empty-experts": [[0, 3], [3, 0], [7, 3], [0, 7], [3, 5]],
    "one-token": [[5, 2]],
    "top3": [[0, 1, 2], [2, 1, 0], [7, 6, 5], [1, 7, 3], [3, 4, 0], [6, 0, 1], [4, 2, 7]],
    "top1": [[3], [3], [0], [7], [3], [1]],
}


def routing(name: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """(x [T, D], topk_ids [T, k], topk_w [T, k]) for a named routing."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor(ROUTINGS[name])
    x = torch.randn(ids.shape[0], D, generator=g).to(dtype)
    w = torch.rand(ids.shape, generator=g).to(dtype)
    return x, ids, w


def random_experts(seed: int = 0, dtype: torch.dtype = torch.float32) -> Experts:
    torch.manual_seed(seed)
    experts = Experts(E, D, I)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return experts.to(dtype)


@contextlib.contextmanager
def dispatch_path(experts: torch.nn.Module, device_groups: bool, chunk: int = 3):
    """Force the device-groups path (one grouped call over all experts) or chunks of `chunk` active experts."""
    experts.chunk_size = lambda rows, device: None if device_groups else chunk
    try:
        yield
    finally:
        del experts.chunk_size
