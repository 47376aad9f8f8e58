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


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.skipif(not _hopper(), reason="the grouped warpgroup-MMA kernel is Hopper's (sm_90)")
def test_int4_expert_chunks_run_through_the_grouped_wgmma_kernels(monkeypatch):
    """Chunks of int4 experts (host-read sizes: the training path) run their forward and dX through
    kernels.grouped_prefill_linear, each chunk's experts by id, and give the chunked dequantize + grouped GEMM path's
    outputs and input gradients up to bf16 rounding: both multiply the same bf16-decoded weights in fp32."""
    from orbit_lightning.kernels import configs

    from orbit_lightning.triton_kernels import kernels_module

    k = kernels_module()
    served = []
    real = k.grouped_prefill_linear
    monkeypatch.setattr(k, "grouped_prefill_linear",
                        lambda *a, dx=False, **kw: served.append((dx, real(*a, dx=dx, **kw))) or served[-1][1])
    e, d, i = 16, 1024, 512
    with torch.device("meta"):
        meta = Experts(e, d, i).to(torch.bfloat16)
    experts = QuantExperts.from_experts(meta, "int4").to_empty(device="cuda")
    experts.random_init(torch.Generator(device="cuda").manual_seed(1))
    experts.chunk = 5  # chunks of 5, 5, 5 and 1 active experts: ids into the stacked weights
    gen = torch.Generator(device="cuda").manual_seed(2)
    # 2048 routed rows, 128 per expert: past the device groups' 64 (quant.dispatch.FUSED_MAX_ROWS), so chunks.
    x = torch.randn(512, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    ids = torch.randint(0, e, (512, 4), device="cuda", generator=gen)
    w = torch.rand(512, 4, device="cuda", dtype=torch.bfloat16, generator=gen)
    results = []
    for wgmma in (True, False):
        monkeypatch.setattr(configs, "WGMMA_INT4", wgmma)
        xg = x.clone().requires_grad_()
        y = experts(xg, ids, w)
        y.float().pow(2).sum().backward()
        results.append((y.detach().float(), xg.grad.float()))
    # Per run, 3 projections x 4 chunks forward, then as many dX (128 rows per expert: within both kernels' bounds).
    assert [dx for dx, _ in served] == ([False] * 12 + [True] * 12) * 2
    assert all(y is not None for _, y in served[:24]) and all(y is None for _, y in served[24:])  # (then switched off)
    (y_wg, dx_wg), (y_dq, dx_dq) = results
    assert (y_wg - y_dq).abs().max() <= 2.0**-7 * y_dq.abs().max()
    assert (dx_wg - dx_dq).abs().max() <= 2.0**-6 * dx_dq.abs().max()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tiled_int4_layers_give_row_major_bits_at_every_row_count():
    """An int4-tiled QuantLinear and an int4 one holding the same values (N = K = 4096: whole blocks; every path
    takes both at these rows: the mma GEMV at 1 and 12 rows on one config, wgmma_int4 at 40 and 300, dequantize + cuBLAS
    at 700; dX: the tile kernel to 64 rows, dequantize + matmul past it) give the same input gradients, and outputs,
    bit for bit: each kernel reads the same values in the same order from either layout, but for the mma GEMV, whose
    mmas take a word's values in other sets from int4-tiled's nibble order (gemv_mma.tile_asm): there the outputs
    agree to the fp32 sums' reordering."""
    from orbit_lightning.quant.linear import QuantLinear

    layers = [QuantLinear(4096, 4096, fmt, dtype=torch.bfloat16).cuda() for fmt in ("int4", "int4-tiled")]
    layers[0].random_init(torch.Generator(device="cuda").manual_seed(3))
    for key, t in layers[0].packed().items():  # the same values, stored as each layout stores them
        layers[1].load_checkpoint_tensor(key, t, None, key)
    assert layers[1].fmt.name == "int4-tiled"
    for m in (1, 12, 40, 300, 700):
        gen = torch.Generator(device="cuda").manual_seed(m)
        x, dy = (torch.randn(m, 4096, generator=gen, device="cuda").bfloat16() for _ in range(2))
        outs, grads = [], []
        for layer in layers:
            xi = x.clone().requires_grad_()
            y = layer(xi)
            y.backward(dy)  # (one dy for both: a dy made from y would carry the outputs' reordering into dX)
            outs.append(y.detach())
            grads.append(xi.grad)
        assert outs[0].isfinite().all(), m
        if m <= 16:  # two fp32 sums of the same 4096 products (apart by ~2^-12 of one product's size) rounded to bf16:
            # at most a bf16 step (2^-7 relative) apart, or, near zero, a sliver of the largest output
            a, b = outs[0].float(), outs[1].float()
            assert ((a - b).abs() <= 2.0**-7 * a.abs() + 2.0**-16 * a.abs().max()).all(), m
        else:
            assert torch.equal(outs[0], outs[1]), m
        assert torch.equal(grads[0], grads[1]), m


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_int4_loads_tiled_on_cuda_unless_asked_for_row_major():
    """model.int4_layout=auto: an int4 model built on CUDA stores its tileable layers in int4-tiled (the decode
    kernels' layout), its narrow ones row-major; row-major on request."""
    from orbit_lightning import load_model

    shape = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, head_dim=64)
    names = {layout: {m.fmt.name for m in load_model("tiny-qwen3-moe", device="cuda", quant="int4",
                                                     int4_layout=layout, **shape).modules() if hasattr(m, "fmt")}
             for layout in ("auto", "row-major")}
    assert "int4-tiled" in names["auto"] and names["row-major"] == {"int4"}
