"""GPU: bf16 transients of packed experts stay within one chunk (torch.cuda.max_memory_allocated)."""

import pytest
import torch

from orbit_lightning.models.moe import Experts
from orbit_lightning.quant.experts import QuantExperts

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", ["int4", "fp8", "nvfp4"])
def test_moe_peak_memory_is_one_chunk_on_gpu(fmt):
    e, d, i, chunk = 64, 2048, 768, 4  # a Qwen3-30B-A3B expert layer
    with torch.device("meta"):
        meta = Experts(e, d, i).to(torch.bfloat16)
    experts = QuantExperts.from_experts(meta, fmt).to_empty(device="cuda")
    experts.random_init(torch.Generator(device="cuda").manual_seed(0))
    experts.chunk = chunk
    t, topk = 512, 8
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ids = torch.randint(0, e, (t, topk), device="cuda")
    w = torch.rand(t, topk, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    experts(x, ids, w).float().pow(2).sum().backward()
    torch.cuda.synchronize()
    transient = torch.cuda.max_memory_allocated() - base
    chunk_bf16 = chunk * d * i * 2
    activations = 12 * t * topk * max(d, i) * 2
    assert transient <= 3 * chunk_bf16 + activations, (transient, chunk_bf16)  # dequant temporaries: see bench
    assert transient < 3 * e * d * i * 2 / 4  # far below a BF16 copy of all experts
