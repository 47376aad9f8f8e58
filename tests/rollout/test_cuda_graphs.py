"""CUDA-graph decode: bucket helpers on the CPU; graph vs eager equality on the GPU (marker `gpu`)."""

import pytest
import torch

from orbit_lightning import load_model
from orbit_lightning.rollout import RolloutEngine, SamplingParams
from orbit_lightning.rollout.cuda_graphs import batch_buckets, capture_blocker
from orbit_lightning.rollout.runner import width_bucket
from tests.rollout.helpers import lora_model, prompts, random_adapter_state

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_buckets(256)[-3:] == [224, 240, 256]
    assert [width_bucket(n, 64) for n in (1, 2, 3, 4, 5, 33, 64)] == [1, 2, 4, 4, 8, 64, 64]
    assert width_bucket(40, 40) == 40  # capped at the longest possible table


def test_capture_blockers_are_named():
    assert "CUDA device" in capture_blocker(load_model("tiny-qwen3"), torch.device("cpu"))
    assert "MoE" in capture_blocker(load_model("tiny-qwen3-moe"), torch.device("cuda"))
    assert capture_blocker(load_model("tiny-deepseek-v3", first_k_dense_replace=2), torch.device("cuda")) is None


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3-moe", "tiny-deepseek-v3"])
def test_graph_decode_equals_eager(preset):
    model = lora_model(preset).cuda()  # int4 base; LoRA on attention, MLP and (MoE) the routed experts
    ps = prompts(256, [5, 17, 9], seed=20)
    params = [SamplingParams(n=3, temperature=1.0, max_new_tokens=40, seed=3, ignore_eos=True),
              SamplingParams(temperature=0, max_new_tokens=25, ignore_eos=True),
              SamplingParams(n=2, temperature=0.7, top_p=0.9, max_new_tokens=33, seed=4, ignore_eos=True)]
    eager = RolloutEngine(model, kv_budget_bytes=1 << 24, block_size=4, cuda_graphs=False)
    graphed = RolloutEngine(model, kv_budget_bytes=1 << 24, block_size=4)
    assert graphed.stats()["cuda_graphs"] == "on"
    want, got = eager.generate(ps, params), graphed.generate(ps, params)
    assert graphed.stats()["graphs_captured"] > 1  # several batch / width buckets were captured
    for w, g in zip(want, got):
        for cw, cg in zip(w.outputs, g.outputs):
            assert cg.token_ids == cw.token_ids
            assert max(abs(a - b) for a, b in zip(cw.logprobs, cg.logprobs)) <= 1e-4
    # A second slot gets its own graphs; staging writes into the captured buffers in place (expert LoRA too).
    state = {k: v.cuda() for k, v in random_adapter_state(model, 1).items()}
    for e in (eager, graphed):
        e.stage_adapter(1, state)
        e.activate_adapter(1)
    want, got = eager.generate(ps, params), graphed.generate(ps, params)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    assert all(c.adapter_version == 1 for o in got for c in o.outputs)
