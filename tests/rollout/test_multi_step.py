"""Multi-step decode (`RolloutEngine(decode_steps=N)`): N tokens per sequence per engine step, fed back on the
device. It must change nothing a caller sees: the same tokens, log-probs, finish reasons and adapter versions
as one token per step, including stops inside a step, preemption and sequences of different lengths."""

import pytest
import torch

from orbit_lightning.rollout import RolloutEngine, SamplingParams, runner
from orbit_lightning.rollout.blocks import BlockAllocator
from orbit_lightning.rollout.scheduler import Scheduler
from orbit_lightning.rollout.sequence import Request, Sequence
from tests.rollout.helpers import LOGPROB_TOL, lora_model, max_logprob_diff, prompts

BIG = 1 << 20
# Mixed requests: seeded sampling (with top-p: the masked path), greedy, stop tokens that fire early, and
# budgets that are not multiples of the step count.
PARAMS = [
    SamplingParams(n=2, temperature=1.0, max_new_tokens=11, seed=5, ignore_eos=True),
    SamplingParams(temperature=0, max_new_tokens=9, ignore_eos=True),
    SamplingParams(n=2, temperature=0.8, top_p=0.9, max_new_tokens=13, seed=8, ignore_eos=True),
    SamplingParams(temperature=1.0, max_new_tokens=16, seed=2, stop_token_ids=list(range(0, 256, 3))),
]


def _summary(outs):
    return [[(c.token_ids, c.finish_reason, c.adapter_versions) for c in o.outputs] for o in outs]


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_multi_step_decode_equals_single_step(preset):
    model = lora_model(preset)
    ps = prompts(256, [6, 11, 4, 9], seed=3)
    single = RolloutEngine(model, kv_budget_bytes=BIG, block_size=4, decode_steps=1)
    multi = RolloutEngine(model, kv_budget_bytes=BIG, block_size=4, decode_steps=4)
    want, got = single.generate(ps, PARAMS), multi.generate(ps, PARAMS)
    assert _summary(got) == _summary(want)
    stops = [c for o in got for c in o.outputs if c.finish_reason == "stop"]
    assert stops and all(len(c.token_ids) < 16 for c in stops)  # a stop fired inside a 4-token step
    for p, o in zip(ps, got):
        assert all(max_logprob_diff(model, p, c) <= LOGPROB_TOL for c in o.outputs)
    m, s = multi.stats(), single.stats()
    assert m["steps"] * 2 < s["steps"] and m["decode_forwards"] >= s["decode_forwards"]  # 4 tokens per step
    assert multi.allocator.num_free == multi.allocator.num_usable  # the look-ahead blocks came back too


def test_multi_step_under_preemption_completes_with_unchanged_results():
    model = lora_model("tiny-qwen3")
    ps = prompts(256, [6, 10, 7, 9, 8, 5], seed=4)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=16, seed=3, ignore_eos=True)
    want = RolloutEngine(model, kv_budget_bytes=BIG, block_size=4, decode_steps=1).generate(ps, params)
    tight = RolloutEngine(model, kv_budget_bytes=15 * 4 * 512, block_size=4, decode_steps=4)  # 14 usable blocks
    got = tight.generate(ps, params)
    assert tight.stats()["preemptions"] > 0
    assert _summary(got) == _summary(want)


def _running(scheduler: Scheduler, num_cached: int, table: list[int]) -> Sequence:
    req = Request("r", [1] * num_cached, SamplingParams(max_new_tokens=64), 0)
    seq = Sequence(req, 0, None, [1] * (num_cached + 1), num_cached=num_cached, block_table=table)
    scheduler.running.append(seq)
    return seq


def test_lookahead_reserves_every_slot_or_falls_back_to_one_token():
    alloc = BlockAllocator(8)  # 7 usable
    sched = Scheduler(alloc, block_size=4, max_batch_size=4, max_prefill_tokens=64)
    a = _running(sched, 3, alloc.allocate(1))  # next slots 3..8 span blocks 0, 1, 2
    b = _running(sched, 8, alloc.allocate(2))  # next slots 8..13 span blocks 2, 3
    plan = sched.schedule(lookahead=6)
    assert plan.lookahead == 6 and not plan.preempted
    assert len(a.block_table) == 3 and len(b.block_table) == 4 and alloc.num_free == 0
    a.num_cached, b.num_cached = 9, 14  # six tokens later: another 6 would need a's block 3 and b's block 4
    plan = sched.schedule(lookahead=6)
    assert plan.lookahead == 1 and not plan.preempted and plan.decode == [a, b]  # one token fits: no victim
    a.num_cached = 12  # a's next token needs block 3: with none free, the youngest (b) is preempted for it
    plan = sched.schedule(lookahead=6)
    assert plan.lookahead == 1 and plan.preempted == [b] and plan.decode == [a] and len(a.block_table) == 4


def test_decode_steps_must_be_positive():
    with pytest.raises(ValueError, match="decode_steps"):
        RolloutEngine(lora_model("tiny-qwen3"), kv_budget_bytes=BIG, decode_steps=0)
    assert RolloutEngine(lora_model("tiny-qwen3"), kv_budget_bytes=BIG).decode_steps == 1  # CPU default


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
UNMASKED = [p for p in PARAMS if p.top_p == 1.0]  # the whole step (sampling too) runs in one CUDA graph


def _captured_kinds(engine) -> set[str]:
    return {key[0] for key in engine.runner.graphs._graphs}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_graphed_multi_step_equals_eager_single_step_gpu(preset):
    model = lora_model(preset).cuda()
    ps = prompts(256, [5, 17, 9], seed=21)
    eager = RolloutEngine(model, kv_budget_bytes=1 << 24, block_size=4, cuda_graphs=False, decode_steps=1)
    graphed = RolloutEngine(model, kv_budget_bytes=1 << 24, block_size=4, decode_steps=8)
    want, got = eager.generate(ps, UNMASKED), graphed.generate(ps, UNMASKED)
    # Full calls replay the all-steps graph; the last, shorter ones replay the one-step graph step by step.
    assert _captured_kinds(graphed) == {"steps", "sampled"}
    assert _summary(got) == _summary(want)
    for w, g in zip(want, got):  # fp32; the tolerance of the graph-vs-eager test (test_cuda_graphs.py)
        for cw, cg in zip(w.outputs, g.outputs):
            assert max(abs(a - b) for a, b in zip(cw.logprobs, cg.logprobs)) <= 1e-4
    # The same kernels in one graph or in eight replays: the same bits.
    runner.MULTI_STEP_GRAPH = False
    try:
        replayed = RolloutEngine(model, kv_budget_bytes=1 << 24, block_size=4, decode_steps=8).generate(ps, UNMASKED)
    finally:
        runner.MULTI_STEP_GRAPH = True
    assert _summary(replayed) == _summary(got)
    assert [[c.logprobs for c in o.outputs] for o in replayed] == [[c.logprobs for c in o.outputs] for o in got]


@pytest.mark.gpu
@gpu
def test_multi_step_is_bitwise_single_step_in_deterministic_bf16_gpu():
    """Batch-invariant mode: a row's numbers cannot depend on whether its step was one of eight in a graph."""
    model = lora_model("tiny-qwen3", dtype=torch.bfloat16, device="cuda")
    ps = prompts(256, [5, 17, 9], seed=22)
    runs = [RolloutEngine(model, kv_budget_bytes=1 << 24, block_size=4, deterministic=True, decode_steps=n)
            .generate(ps, UNMASKED) for n in (1, 8)]
    assert _summary(runs[1]) == _summary(runs[0])
    assert [[c.logprobs for c in o.outputs] for o in runs[1]] == [[c.logprobs for c in o.outputs] for o in runs[0]]


def test_multi_step_stops_at_max_model_len_without_running_past_it():
    """The look-ahead never reserves slots past max_model_len: a step is shortened to what the closest sequence
    has left, and sequences end with "length" exactly at the limit, as in single-step decode."""
    model = lora_model("tiny-qwen3")
    ps = prompts(256, [10, 3], seed=6)
    params = SamplingParams(temperature=1.0, seed=1, ignore_eos=True, max_new_tokens=None)  # the context bounds it
    engines = [RolloutEngine(model, kv_budget_bytes=BIG, block_size=4, max_model_len=17, decode_steps=n)
               for n in (1, 4)]
    want, got = (e.generate(ps, params) for e in engines)
    assert _summary(got) == _summary(want)
    assert [len(o.outputs[0].token_ids) for o in got] == [7, 14]  # 17 - prompt length
    assert all(o.outputs[0].finish_reason == "length" for o in got)
