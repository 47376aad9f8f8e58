"""L2 prefetch (kernels/prefetch.py): a hint that must change no value, and a no-op where it cannot run."""

import pytest
import torch
from orbit_lightning.kernels.prefetch import CHUNK, prefetch_available, prefetch_l2

from orbit_lightning import kernels
from orbit_lightning.quant.formats import get_format


def test_prefetch_is_a_no_op_without_a_gpu_that_has_it():
    t = torch.arange(4096, dtype=torch.int32)
    assert not prefetch_available(t.device)
    assert prefetch_l2([t]) == 0
    assert torch.equal(t, torch.arange(4096, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prefetch_requests_the_spans_and_changes_no_result_gpu():
    if not prefetch_available(torch.device("cuda")):
        pytest.skip("cp.async.bulk.prefetch needs sm_90+")
    fmt = get_format("int4")
    torch.manual_seed(0)
    packed = fmt.random_packed((1000, 4096), device="cuda")  # rows of 2048 + 256 bytes: 16-byte multiples
    tensors = [packed["weight_packed"], packed["weight_scale"]]
    before = [t.clone() for t in tensors]
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    y0 = kernels.dequant_linear(x, fmt, packed)
    n_bytes = sum(t.numel() * t.element_size() for t in tensors)
    assert prefetch_l2(tensors) == n_bytes
    assert prefetch_l2(tensors, max_bytes=CHUNK + 100) == CHUNK + 96  # cut to the budget, in 16-byte units
    assert prefetch_l2([tensors[0][:, 1:]]) == 0  # a strided view is not one span: skipped
    y1 = kernels.dequant_linear(x, fmt, packed)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))
    assert torch.equal(y0, y1)
    # Several launches' worth of segments (MAX_SEGMENTS per launch), under CUDA-graph capture as in the engine.
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        prefetch_l2(tensors * 3)
        y2 = kernels.dequant_linear(x, fmt, packed)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y2, y0)
