"""MoE decode under CUDA graphs. CPU: the reasons `capture_blocker` gives for MoE models. GPU (marker `gpu`): an
MoE layer's forward runs without a host sync and captures in a CUDA graph (softmax and DeepSeek's grouped sigmoid
router; packed experts with expert LoRA, plain bf16 experts). Whole-engine graph vs eager decode of MoE models:
tests/rollout/test_cuda_graphs.py."""

import pytest
import torch

from orbit_lightning import load_model
from orbit_lightning.models.moe import MoE
from orbit_lightning.rollout.cuda_graphs import capture_blocker
from tests.rollout.helpers import lora_model

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA = torch.device("cuda")


def test_moe_capture_blockers():
    assert "CUDA device" in capture_blocker(lora_model("tiny-qwen3-moe"), torch.device("cpu"))
    reason = capture_blocker(load_model("tiny-qwen3-moe", dtype=torch.float32), CUDA)
    assert "MoE experts" in reason and "bf16" in reason  # plain fp32 experts: torch's grouped GEMM is bf16-only
    packed = capture_blocker(lora_model("tiny-qwen3-moe"), CUDA)
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0):
        assert packed is None  # int4 experts + expert LoRA: the fused grouped kernel on device offsets
    else:
        assert "MoE experts" in packed and "cannot run on cuda" in packed
    # Batch-invariant decode: the fused kernel is invariant, expert LoRA only group by group (host-read sizes).
    reason = capture_blocker(lora_model("tiny-qwen3-moe"), CUDA, deterministic=True)
    assert "MoE experts" in reason and ("expert LoRA" in reason or packed is not None)
    no_lora = capture_blocker(load_model("tiny-qwen3-moe", dtype=torch.float32, quant="int4"), CUDA, deterministic=True)
    assert no_lora == packed


def _model(preset: str, kind: str):
    if kind == "plain-bf16":
        if torch.cuda.get_device_capability()[0] not in (9, 10):
            pytest.skip("torch's grouped GEMM is sync-free on sm90 / sm100 only")
        return load_model(preset, dtype=torch.bfloat16, seed=1).cuda()
    return lora_model(preset, **({"first_k_dense_replace": 0} if preset == "tiny-deepseek-v3" else {})).cuda()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    "preset,kind",
    [("tiny-qwen3-moe", "int4-lora"), ("tiny-deepseek-v3", "int4-lora"), ("tiny-qwen3-moe", "plain-bf16")],
)
@pytest.mark.parametrize("batch", [1, 8])
def test_moe_layer_forward_is_sync_free_and_captures(preset, kind, batch):
    model = _model(preset, kind)
    assert capture_blocker(model, CUDA) is None
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
    g = torch.Generator("cuda").manual_seed(0)
    x, x2 = (torch.randn(batch, 1, model.config.hidden_size, device="cuda", generator=g).to(dtype) for _ in "ab")
    with torch.no_grad():
        moe(x)  # compile / tune outside the checks
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            eager = moe(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        static = x.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            moe(static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe(static)
        graph.replay()
        torch.testing.assert_close(out, eager)  # the same kernels replayed
        static.copy_(x2)
        graph.replay()
        torch.testing.assert_close(out, moe(x2))  # replays read the new input: nothing was baked in
