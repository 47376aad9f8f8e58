"""bench/moe_paths.py times what the model runs: its chunked path gives every routed row its expert's product,
whatever the chunk size (CPU, fp32, against a per-expert float64 reference)."""

import importlib.util
import itertools
from pathlib import Path

import pytest
import torch

from orbit_lightning.quant.experts import QuantExperts

_spec = importlib.util.spec_from_file_location("moe_paths", Path(__file__).parents[2] / "bench" / "moe_paths.py")
moe_paths = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(moe_paths)


@pytest.mark.parametrize("dx", [False, True])
def test_the_chunked_path_multiplies_every_row_by_its_experts_weight(dx):
    experts = QuantExperts(6, 64, 32, "int4", dtype=torch.float32)
    experts.random_init(torch.Generator().manual_seed(0))
    counts = [3, 0, 5, 2, 0, 4]  # two experts without rows
    w = experts.dequantize("gate_proj", dtype=torch.float64)  # [E, N=32, K=64]
    a = torch.randn(sum(counts), 32 if dx else 64, generator=torch.Generator().manual_seed(1))
    starts = [0, *itertools.accumulate(counts)]
    want = torch.cat([a[s:s + n].double() @ (w[e] if dx else w[e].T) for e, (s, n) in enumerate(zip(starts, counts))])
    for chunk in (1, 2, 6):
        got = torch.cat(moe_paths.chunked(a, experts, "gate_proj", counts, chunk, dx))
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5), chunk  # fp32 products of fp32 weights
