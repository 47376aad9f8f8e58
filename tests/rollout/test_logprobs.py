"""Same path, proved: the engine's per-token log-probs equal the trainer's teacher-forced forward (adapter on)."""

import pytest
import torch

from orbit_lightning.rollout import RolloutEngine, SamplingParams
from tests.rollout.helpers import LOGPROB_TOL, lora_model, max_logprob_diff, prompts, teacher_forced


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3-moe", "tiny-deepseek-v3"])
def test_engine_logprobs_match_trainer_forward(preset):
    model = lora_model(preset)
    ps = prompts(model.config.vocab_size, [7, 3, 18, 12], seed=2)
    params = [SamplingParams(n=3, temperature=0.8, top_p=0.9, top_k=40, max_new_tokens=14, seed=5, ignore_eos=True),
              SamplingParams(n=1, temperature=1.3, max_new_tokens=20, seed=6, ignore_eos=True),
              SamplingParams(n=2, temperature=0, max_new_tokens=9, ignore_eos=True),
              SamplingParams(n=2, temperature=1.0, max_new_tokens=17, seed=7, ignore_eos=True)]
    engine = RolloutEngine(model, kv_budget_bytes=1 << 20, block_size=4, max_model_len=64)
    outs = engine.generate(ps, params)
    worst = 0.0
    for p, o, sp in zip(ps, outs, params):
        assert len(o.outputs) == sp.n
        for c in o.outputs:
            assert len(c.token_ids) == len(c.logprobs) == sp.max_new_tokens
            worst = max(worst, max_logprob_diff(model, p, c))
    # The trainer scores untempered, unfiltered logits; requests above sampled at T = 0.8 / 1.3 with top-k/p,
    # so the match also shows that temperature and filtering did not leak into the recorded log-probs.
    assert worst <= LOGPROB_TOL
    with torch.no_grad(), model.disable_adapter():
        ref = teacher_forced(model, ps[1], outs[1].outputs[0].token_ids)
    assert (ref - torch.tensor(outs[1].outputs[0].logprobs)).abs().max() > 1e-3  # and the adapter was on
