"""Per-request errors, the step/abort API, the asyncio front end and engine-level argument checks."""

import asyncio
import re

import pytest

from orbit_lightning.rollout import AsyncRolloutEngine, RolloutEngine, SamplingParams
from tests.rollout.helpers import lora_model, prompts, random_adapter_state

GREEDY = SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return lora_model("tiny-qwen3")


def test_bad_requests_get_errors_and_the_others_run(model):
    good = prompts(256, [4, 6], seed=12)
    # fp32 tiny-qwen3: 512 B per token, so 8 blocks of 16 tokens (one reserved) = 7 usable blocks.
    engine = RolloutEngine(model, kv_budget_bytes=8 * 16 * 512, block_size=16, max_model_len=128)
    cases = [
        ([], GREEDY, "empty prompt"),
        (good[0], SamplingParams(max_new_tokens=-1), "max_new_tokens must be"),
        (good[0], SamplingParams(temperature=-0.5), "temperature must be"),
        (good[0], SamplingParams(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (good[0], SamplingParams(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (good[0], SamplingParams(n=0), "n must be"),
        (good[0], SamplingParams(top_k=-4), "top_k must be"),
        (good[0], SamplingParams(stop=["x"]), "stop strings need a tokenizer"),
        ("some text", GREEDY, "text prompts need a tokenizer"),
        ([1, 999], GREEDY, "outside the vocabulary"),
        (list(range(128)), GREEDY, "prompt of 128 tokens leaves no room"),
        (good[0], SamplingParams(max_new_tokens=120), "124 tokens needs 8 KV blocks but the whole cache has 7"),
        (good[0], {"temperature": 0}, "must be a SamplingParams"),
    ]
    ps = [good[0]] + [c[0] for c in cases] + [good[1]]
    params = [GREEDY] + [c[1] for c in cases] + [GREEDY]
    outs = engine.generate(ps, params)
    alone = RolloutEngine(model, kv_budget_bytes=1 << 20).generate([good[0], good[1]], GREEDY)
    for got, want in zip((outs[0], outs[-1]), alone):
        assert got.error is None and got.outputs[0].token_ids == want.outputs[0].token_ids
    for (_, _, msg), out in zip(cases, outs[1:-1]):
        assert out.finished and out.outputs == [] and out.error is not None
        assert re.search(msg, out.error), (msg, out.error)


def test_step_api_streams_and_aborts(model):
    engine = RolloutEngine(model, kv_budget_bytes=1 << 20, block_size=4)
    a, b = prompts(256, [5, 3], seed=13)
    engine.add_request(a, SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True), request_id="long")
    engine.add_request(b, GREEDY, request_id="short")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(b, GREEDY, request_id="short")
    with pytest.raises(RuntimeError, match="needs an idle engine"):
        engine.generate([a], GREEDY)
    lengths = []
    for _ in range(6):
        for out in engine.step():
            if out.request_id == "long":
                lengths.append(len(out.outputs[0].token_ids))
    assert lengths == [1, 2, 3, 4, 5, 6]  # one token per step, streamed
    engine.abort("long")
    (final,) = engine.step()
    assert final.finished and final.outputs[0].finish_reason == "abort" and len(final.outputs[0].token_ids) == 6
    assert not engine.has_unfinished() and engine.allocator.num_free == engine.allocator.num_usable


def test_async_engine_streams_requests_and_waits_to_stage(model):
    engine = RolloutEngine(model, kv_budget_bytes=1 << 20, block_size=4)
    ps = prompts(256, [5, 8], seed=14)
    want = RolloutEngine(model, kv_budget_bytes=1 << 20).generate(ps, GREEDY)
    aeng = AsyncRolloutEngine(engine)

    async def main():
        stream = aeng.generate(ps[0], SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True))
        first = await anext(stream)  # the long request has started on version 0
        engine.stage_adapter(1, random_adapter_state(model, 5))
        aeng.activate_adapter(1)  # it keeps version 0 in slot0...
        staged = asyncio.create_task(aeng.stage_adapter(2, random_adapter_state(model, 6)))  # ...so this waits
        short = [out async for out in aeng.generate(ps[1], GREEDY)]
        assert not staged.done()
        long = [first] + [out async for out in stream]
        await staged
        return long, short

    long, short = asyncio.run(main())
    assert engine.slots.version["slot0"] == 2
    assert len(long) == 20 and long[-1].finished and long[-1].outputs[0].adapter_versions == [0] * 20
    assert long[-1].outputs[0].token_ids[:5] == want[0].outputs[0].token_ids
    assert short[-1].outputs[0].adapter_version == 1


def test_engine_argument_errors(model):
    with pytest.raises(ValueError, match="not both"):
        RolloutEngine(model, kv_budget_bytes=1 << 20, kv_fraction=0.1)
    with pytest.raises(ValueError, match="at least 2 are needed"):
        RolloutEngine(model, kv_budget_bytes=100)
    with pytest.raises(ValueError, match="max_model_len"):
        RolloutEngine(model, kv_budget_bytes=1 << 20, max_model_len=10**6)
    with pytest.raises(ValueError, match="adapter policy"):
        RolloutEngine(model, kv_budget_bytes=1 << 20, adapter_policy="merge")


