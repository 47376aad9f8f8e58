"""Versioned double-buffered adapter slots: staging and activation between steps of a running generation."""

import pytest
import torch

from orbit_lightning import load_model
from orbit_lightning.adapters import adapter_state, adapter_state_dict
from orbit_lightning.rollout import AdapterSlotBusy, RolloutEngine, SamplingParams
from tests.rollout.helpers import (
    LOGPROB_TOL,
    lora_model,
    max_logprob_diff,
    prompts,
    random_adapter_state,
    teacher_forced,
)

LONG = SamplingParams(n=2, temperature=1.0, max_new_tokens=24, seed=11, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)


def _drain(engine, finals):
    while engine.has_unfinished():
        finals.update({o.request_id: o for o in engine.step() if o.finished})


def test_in_flight_sequences_finish_on_their_version():
    model = lora_model("tiny-qwen3-moe")
    v0, v1, v2 = adapter_state_dict(model), random_adapter_state(model, 1), random_adapter_state(model, 2)
    v0 = {k: t.clone() for k, t in v0.items()}
    engine = RolloutEngine(model, kv_budget_bytes=1 << 20, block_size=4)
    assert engine.adapter_version == 0
    a_prompt, b_prompt = prompts(256, [7, 5], seed=8)
    engine.add_request(a_prompt, LONG, request_id="a")
    finals = {}
    for _ in range(5):
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    engine.stage_adapter(1, v1)  # decoding of "a" continues on slot0 undisturbed
    engine.step()
    engine.activate_adapter(1)
    engine.add_request(b_prompt, SHORT, request_id="b")
    engine.step()
    with pytest.raises(AdapterSlotBusy, match="still decode with version 0"):
        engine.stage_adapter(2, v2)  # would overwrite the slot that "a" still reads
    assert not engine.can_stage()
    _drain(engine, finals)
    assert engine.can_stage()
    a, b = finals["a"], finals["b"]
    for c in a.outputs:
        assert c.adapter_version == 0 and c.adapter_versions == [0] * 24
        assert max_logprob_diff(model, a_prompt, c, adapter=v0) <= LOGPROB_TOL
    assert b.outputs[0].adapter_versions == [1] * 6
    assert max_logprob_diff(model, b_prompt, b.outputs[0], adapter=v1) <= LOGPROB_TOL
    engine.stage_adapter(2, v2)  # slot0 has drained
    engine.activate_adapter(2)
    assert adapter_state(model).versions["slot0"] == 2 and engine.adapter_version == 2


def test_switch_policy_moves_in_flight_sequences():
    model = lora_model("tiny-qwen3")
    v0 = {k: t.clone() for k, t in adapter_state_dict(model).items()}
    engine = RolloutEngine(model, kv_budget_bytes=1 << 20, block_size=4, adapter_policy="switch")
    prompt = prompts(256, [6], seed=9)[0]
    engine.add_request(prompt, LONG, request_id="a")
    for _ in range(4):
        engine.step()
    engine.stage_adapter(7, random_adapter_state(model, 3))
    engine.activate_adapter(7)
    assert engine.can_stage()  # nothing reads the old slot any more
    finals = {}
    _drain(engine, finals)
    for c in finals["a"].outputs:
        assert c.adapter_version == 0 and c.adapter_versions == [0] * 4 + [7] * 20
        # Tokens made before the switch are the version-0 policy's; the later ones are not.
        diff = (teacher_forced(model, prompt, c.token_ids, v0) - torch.tensor(c.logprobs)).abs()
        assert diff[:4].max() <= LOGPROB_TOL and diff[4:].max() > 1e-3


def test_bad_stage_and_activate_leave_the_active_slot_untouched():
    model = lora_model("tiny-deepseek-v3")
    engine = RolloutEngine(model, kv_budget_bytes=1 << 20, block_size=4)
    p = prompts(256, [5], seed=10)
    before = engine.generate(p, SHORT)[0].outputs[0]
    good = random_adapter_state(model, 4)
    slot_before = {k: t.clone() for k, t in adapter_state_dict(model, "slot1").items()}

    wrong_shape = dict(good)
    key = next(iter(wrong_shape))
    wrong_shape[key] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=f"{key}: shape"):
        engine.stage_adapter(1, wrong_shape)
    missing = dict(good)
    missing.pop(key)
    with pytest.raises(ValueError, match="missing"):
        engine.stage_adapter(1, missing)
    with pytest.raises(KeyError, match="version 1 is not staged"):
        engine.activate_adapter(1)
    with pytest.raises(TypeError, match="must be an int"):
        engine.stage_adapter("v1", good)

    # Nothing was written to the inactive slot, the active version is unchanged, and so is the output.
    assert all(torch.equal(t, slot_before[k]) for k, t in adapter_state_dict(model, "slot1").items())
    assert engine.adapter_version == 0 and engine.slots.version["slot1"] is None
    after = engine.generate(p, SHORT)[0].outputs[0]
    assert after.token_ids == before.token_ids and after.logprobs == before.logprobs
    with model.disable_adapter():  # the engine always decodes the recorded version's policy, adapter on
        inside = engine.generate(p, SHORT)[0].outputs[0]
    assert inside.logprobs == before.logprobs


def test_model_without_adapter_has_no_versions():
    model = load_model("tiny-qwen3", dtype=torch.float32)
    engine = RolloutEngine(model, kv_budget_bytes=1 << 20)
    out = engine.generate(prompts(256, [4]), SHORT)[0].outputs[0]
    assert out.adapter_version is None and out.adapter_versions == [None] * 6
    with pytest.raises(ValueError, match="no adapter"):
        engine.stage_adapter(1, {})


def test_restaging_the_active_version_number_switches_to_the_new_weights():
    """A resumed run pushes the trainer's adapter under the version number the engine already serves."""
    model = lora_model("tiny-qwen3")
    engine = RolloutEngine(model, kv_budget_bytes=1 << 20)
    p = prompts(256, [5], seed=16)
    before = engine.generate(p, SHORT)[0].outputs[0]
    engine.activate_adapter(0)  # already active, nothing staged: a no-op
    new = random_adapter_state(model, 8)
    engine.stage_adapter(0, new)
    engine.activate_adapter(0)
    after = engine.generate(p, SHORT)[0].outputs[0]
    assert after.adapter_version == 0 and after.logprobs != before.logprobs
    assert max_logprob_diff(model, p[0], after, adapter=new) <= LOGPROB_TOL
    with pytest.raises(KeyError, match="not staged"):
        engine.activate_adapter(3)
