"""Programmatic dependent launch (kernels/pdl.py): where it is taken, and that it changes no result.

The wait is a no-op without PDL, so a decode step must give the same bits with and without it; on the GPU a
missing or misplaced wait would show up as a race (stale activations) in the bf16 engine run below.
"""

import pytest
import torch
from orbit_lightning.kernels import pdl

from orbit_lightning.rollout import RolloutEngine
from tests.rollout.test_multi_step import UNMASKED, _summary, lora_model, prompts


def test_pdl_is_taken_only_where_it_runs(monkeypatch):
    assert not pdl.use_pdl(torch.device("cpu"))  # the interpreter: no griddepcontrol
    monkeypatch.setattr(pdl, "ENABLED", False)
    if torch.cuda.is_available():
        assert not pdl.use_pdl(torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_graphed_decode_is_bitwise_the_same_with_and_without_pdl_gpu(preset, monkeypatch):
    model = lora_model(preset, dtype=torch.bfloat16, device="cuda")
    ps = prompts(256, [5, 17, 30], seed=23)  # one prompt per UNMASKED params
    runs = []
    for enabled in (False, True):
        monkeypatch.setattr(pdl, "ENABLED", enabled)
        assert pdl.use_pdl(torch.device("cuda")) == (enabled and torch.cuda.get_device_capability() >= (9, 0))
        runs.append(RolloutEngine(model, kv_budget_bytes=1 << 24, block_size=4, decode_steps=8).generate(ps, UNMASKED))
    assert _summary(runs[1]) == _summary(runs[0])
    assert [[c.logprobs for c in o.outputs] for o in runs[1]] == [[c.logprobs for c in o.outputs] for o in runs[0]]
