"""Continuous batching on the paged cache: seeded reproducibility, preemption, prefix sharing, stopping."""

import torch

from orbit_lightning import load_model
from orbit_lightning.data.tokenizer import CharTokenizer
from orbit_lightning.rollout import RolloutEngine, SamplingParams
from tests.rollout.helpers import LOGPROB_TOL, lora_model, max_logprob_diff, prompts

BIG = 1 << 20


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
    model = lora_model("tiny-qwen3")
    ps = prompts(256, [6, 11, 4, 9], seed=3)
    target = SamplingParams(n=3, temperature=1.0, top_p=0.95, max_new_tokens=10, seed=42, ignore_eos=True)
    alone = RolloutEngine(model, kv_budget_bytes=BIG, block_size=4).generate([ps[1]], target)[0]
    others = [SamplingParams(n=2, temperature=0.7, max_new_tokens=6, seed=1, ignore_eos=True), target,
              SamplingParams(temperature=0, max_new_tokens=13, ignore_eos=True), SamplingParams(max_new_tokens=3)]
    mixed = RolloutEngine(model, kv_budget_bytes=BIG, block_size=8, max_batch_size=3).generate(ps, others)[1]
    assert [c.token_ids for c in mixed.outputs] == [c.token_ids for c in alone.outputs]
    assert len({tuple(c.token_ids) for c in alone.outputs}) == 3  # samples differ from each other
    reseeded = SamplingParams(n=3, temperature=1.0, top_p=0.95, max_new_tokens=10, seed=43, ignore_eos=True)
    other_seed = RolloutEngine(model, kv_budget_bytes=BIG).generate([ps[1]], reseeded)[0]
    assert [c.token_ids for c in other_seed.outputs] != [c.token_ids for c in alone.outputs]


def test_preemption_completes_every_request_with_unchanged_results():
    model = lora_model("tiny-qwen3-moe")
    ps = prompts(256, [6, 10, 7, 9, 8, 5], seed=4)
    params = [SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)] * 5 + [
        SamplingParams(n=2, temperature=1.0, max_new_tokens=16, seed=3, ignore_eos=True)]
    roomy = RolloutEngine(model, kv_budget_bytes=BIG, block_size=4)
    want = roomy.generate(ps, params)
    # fp32, 2 layers, 2 kv heads x (16 + 16) dims = 512 B/token: 15 blocks of 4 tokens hold < 1/3 of the work.
    tight = RolloutEngine(model, kv_budget_bytes=15 * 4 * 512, block_size=4)
    assert tight.allocator.num_usable == 14
    got = tight.generate(ps, params)
    assert tight.stats()["preemptions"] > 0 and roomy.stats()["preemptions"] == 0
    assert _tokens(got) == _tokens(want)
    for p, o in zip(ps, got):
        assert all(max_logprob_diff(model, p, c) <= LOGPROB_TOL for c in o.outputs)
    assert tight.allocator.num_free == tight.allocator.num_usable  # every block came back


def test_samples_share_the_prompt_blocks_with_copy_on_write():
    model = lora_model("tiny-deepseek-v3")
    prompt = prompts(256, [10], seed=5)[0]  # blocks of 4: two full blocks + a half-filled third
    engine = RolloutEngine(model, kv_budget_bytes=BIG, block_size=4)
    engine.add_request(prompt, SamplingParams(n=4, temperature=1.0, max_new_tokens=5, seed=0, ignore_eos=True))
    engine.step()  # prefill once, fork: 4 samples on 3 blocks (not 12)
    assert engine.allocator.num_used == 3
    engine.step()  # first decode writes into the shared third block: 3 samples copy it, the last keeps it
    assert engine.allocator.num_used == 2 + 4
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.finished]
    (out,) = outs
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert all(max_logprob_diff(model, prompt, c) <= LOGPROB_TOL for c in out.outputs)


def test_stop_tokens_eos_and_context_limit():
    model = lora_model("tiny-qwen3")
    prompt = prompts(256, [5], seed=6)[0]
    greedy = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    full = RolloutEngine(model, kv_budget_bytes=BIG).generate([prompt], greedy)[0].outputs[0].token_ids
    stop_at = next(i for i, t in enumerate(full) if i >= 3 and t not in full[:i])
    tok = full[stop_at]
    out = RolloutEngine(model, kv_budget_bytes=BIG).generate(
        [prompt], SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=[tok]))[0].outputs[0]
    assert out.token_ids == full[: stop_at + 1] and (out.finish_reason, out.stop_reason) == ("stop", tok)

    model.config.eos_token_id = tok  # EOS ends a sample unless ignore_eos
    out = RolloutEngine(model, kv_budget_bytes=BIG).generate([prompt], SamplingParams(temperature=0,
                                                                                         max_new_tokens=12))[0]
    assert out.outputs[0].token_ids == full[: stop_at + 1] and out.outputs[0].stop_reason is None
    model.config.eos_token_id = None

    limited = RolloutEngine(model, kv_budget_bytes=BIG, max_model_len=9)
    out = limited.generate([prompt], SamplingParams(temperature=0, max_new_tokens=None))[0].outputs[0]
    assert out.token_ids == full[:4] and out.finish_reason == "length"
    out = limited.generate([prompt], SamplingParams(max_new_tokens=0))[0].outputs[0]
    assert out.token_ids == [] and out.finish_reason == "length"


def test_text_prompts_and_stop_strings_with_a_tokenizer():
    tok = CharTokenizer()
    model = load_model("tiny-qwen3", dtype=torch.float32, vocab_size=tok.vocab_size)
    engine = RolloutEngine(model, tok, kv_budget_bytes=BIG)
    full = engine.generate(["12+3="], SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True))[0]
    toks, text = full.outputs[0].token_ids, full.outputs[0].text
    assert full.prompt == "12+3=" and full.prompt_token_ids == tok.encode("12+3=")
    assert text == tok.decode(toks)
    stop = text[5:7]
    # Generation must end on the token whose decoded prefix first contains the stop string.
    cut = next(i for i in range(len(toks)) if stop in tok.decode(toks[: i + 1])) + 1
    out = engine.generate(["12+3="], SamplingParams(temperature=0, max_new_tokens=16, stop=[stop]))[0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.token_ids == toks[:cut] and cut < 16
    bad = engine.generate(["12+3=", "ABC"], SamplingParams(temperature=0, max_new_tokens=3))
    assert bad[0].error is None and "cannot encode" in bad[1].error and bad[1].prompt == "ABC"


def test_samples_of_a_request_that_just_fits_the_cache_run_one_after_another():
    model = lora_model("tiny-qwen3")
    prompt = prompts(256, [25], seed=7)[0]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=3, seed=2, ignore_eos=True)
    want = RolloutEngine(model, kv_budget_bytes=BIG, block_size=4).generate([prompt], params)[0]
    # 7 usable blocks of 4 = 28 tokens: one sample (25 + 3) fits exactly, two cannot share the cache.
    tight = RolloutEngine(model, kv_budget_bytes=8 * 4 * 512, block_size=4)
    got = tight.generate([prompt], params)[0]
    assert got.error is None and [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    assert tight.peak_used_blocks == 7
