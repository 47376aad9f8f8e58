"""Greedy decoding equals transformers' greedy `generate` on the dequantized base with the LoRA merged by PEFT.

The engine runs the packed int4 base with the LoRA beside it; the oracle is transformers' own model loaded from
our exported (dequantized) weights, with PEFT's `merge_and_unload()` folding the adapter in.
"""

import peft
import pytest
import torch

from orbit_lightning import add_adapter, export_hf_state_dict, load_model, save_adapter
from orbit_lightning.rollout import RolloutEngine, SamplingParams
from tests.hf_models import hf_from_export, make_hf_model, save_hf_model
from tests.rollout.helpers import max_logprob_diff, prompts, randomize_adapter

NEW = 12
CASES = [
    ("qwen3-gqa2", "all-linear"),
    ("qwen3_moe-top2", ["q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),  # incl. routed experts
    ("deepseek_v3-qlora", ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]),
]


def _hf_greedy(hf, prompt: list[int]) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name,targets", CASES)
def test_greedy_matches_transformers_with_merged_lora(name, targets, tmp_path):
    src = save_hf_model(make_hf_model(name), tmp_path / "base")
    ours = load_model(src, quant="int4", dtype=torch.float32)
    add_adapter(ours, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    randomize_adapter(ours)
    save_adapter(ours, tmp_path / "adapter")
    hf = hf_from_export(export_hf_state_dict(ours, dtype=torch.float32), src, tmp_path / "exported")
    hf.generation_config.eos_token_id = None  # run the full length, as ignore_eos does

    ps = prompts(hf.config.vocab_size, [5, 9, 3], seed=1)
    with torch.no_grad():
        base_only = [_hf_greedy(hf, p) for p in ps]
        merged = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").merge_and_unload().eval()
        want = [_hf_greedy(merged, p) for p in ps]
    assert want != base_only  # the adapter changes the greedy path, so the comparison is not vacuous

    for decode_steps in (1, 4):  # one token per engine step, and multi-step decode (tokens fed back on device)
        engine = RolloutEngine(ours, kv_budget_bytes=1 << 20, block_size=4, max_model_len=64,
                               decode_steps=decode_steps)
        outs = engine.generate(ps, SamplingParams(n=2, temperature=0, max_new_tokens=NEW, ignore_eos=True))
        for p, o, w in zip(ps, outs, want):
            assert o.error is None and [c.token_ids for c in o.outputs] == [w, w]
            assert all(c.finish_reason == "length" for c in o.outputs)
            assert max_logprob_diff(ours, p, o.outputs[1]) <= 1e-5
