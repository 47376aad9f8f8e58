"""Advantage estimators against hand-computed values and fp64 loop references."""

import math

import pytest
import torch

from orbit_lightning.algorithms import (
    ADVANTAGE_ESTIMATORS,
    dr_grpo_advantages,
    get_advantage,
    grpo_advantages,
    register_advantage,
    reinforce_pp_advantages,
    rloo_advantages,
    sequence_to_token_advantages,
)

ESTIMATORS = ["grpo", "dr_grpo", "rloo", "reinforce_pp", "gspo"]


def test_grpo_hand_computed():
    # group [1, 0, 0, 1]: mean 0.5, unbiased std = sqrt(4 * 0.25 / 3) = sqrt(1/3) -> A = +-0.5 * sqrt(3)
    # group [2, 2, 2, 2]: all equal -> 0
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv = grpo_advantages(rewards, 4, eps=0.0)
    a = 0.5 * math.sqrt(3)
    torch.testing.assert_close(adv, torch.tensor([a, -a, -a, a, 0, 0, 0, 0]), rtol=1e-6, atol=0)
    assert adv.dtype == torch.float32


def test_grpo_matches_fp64_loop():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(5 * 6, generator=g)
    adv = grpo_advantages(rewards, 6, eps=1e-6)
    ref = torch.empty(30, dtype=torch.float64)
    for b in range(5):
        r = rewards[b * 6 : (b + 1) * 6].double()
        ref[b * 6 : (b + 1) * 6] = (r - r.mean()) / (r.std() + 1e-6)
    # float32 result of an fp64 computation: one float32 rounding
    torch.testing.assert_close(adv.double(), ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ESTIMATORS)
@pytest.mark.parametrize("value", [0.0, 0.1, 1.0 / 3.0, 7.3])
def test_all_equal_rewards_give_exact_zero(name, value):
    # 0.1 and 1/3 are not exact in binary; a float32 mean could round and leave noise / tiny std.
    rewards = torch.full((2 * 5,), value)
    adv = get_advantage(name)(rewards, 5)
    assert torch.equal(adv, torch.zeros(10))


def test_dr_grpo_and_grpo_without_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 2.0, 2.0])
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5, 1.0, -1.0, 0.0, 0.0])
    torch.testing.assert_close(dr_grpo_advantages(rewards, 4), expected, rtol=0, atol=1e-7)
    torch.testing.assert_close(grpo_advantages(rewards, 4, scale_by_std=False), expected, rtol=0, atol=1e-7)


def test_rloo_hand_computed():
    # [1, 2, 3, 6]: leave-one-out means 11/3, 10/3, 3, 2 -> A = -8/3, -4/3, 0, 4
    adv = rloo_advantages(torch.tensor([1.0, 2.0, 3.0, 6.0]), 4)
    torch.testing.assert_close(adv, torch.tensor([-8 / 3, -4 / 3, 0.0, 4.0]), rtol=1e-6, atol=1e-6)


def test_rloo_matches_explicit_loop_with_invalid_samples():
    g = torch.Generator().manual_seed(1)
    B, G = 4, 5
    rewards = torch.randn(B * G, generator=g)
    valid = torch.rand(B * G, generator=g) > 0.3
    valid[:G] = True
    rewards[~valid] = float("nan")  # failed reward functions
    adv = rloo_advantages(rewards, G, valid)
    ref = torch.zeros(B * G, dtype=torch.float64)
    for b in range(B):
        idx = [b * G + j for j in range(G) if valid[b * G + j]]
        if len(idx) < 2:
            continue
        for i in idx:
            others = [rewards[j].double() for j in idx if j != i]
            ref[i] = rewards[i].double() - sum(others) / len(others)
    torch.testing.assert_close(adv.double(), ref, rtol=1e-6, atol=1e-6)
    assert torch.isfinite(adv).all()


def test_reinforce_pp_hand_computed():
    # G=2 groups [1, 0], [0, 0], [2, 0] -> centred [.5, -.5, 0, 0, 1, -1]
    # batch unbiased std = sqrt((.25 + .25 + 1 + 1) / 5) = sqrt(.5)
    adv = reinforce_pp_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 0.0]), 2, eps=0.0)
    s = math.sqrt(0.5)
    expected = torch.tensor([0.5 / s, -0.5 / s, 0.0, 0.0, 1 / s, -1 / s])
    torch.testing.assert_close(adv, expected, rtol=1e-6, atol=1e-7)


def test_masked_samples_excluded_from_group_statistics():
    # valid rewards [1, 0, 1]: mean 2/3, centred [1/3, -2/3, 1/3]
    # unbiased std = sqrt((1 + 4 + 1) / 9 / 2) = sqrt(1/3)
    rewards = torch.tensor([1.0, float("nan"), 0.0, 1.0])
    valid = torch.tensor([True, False, True, True])
    adv = grpo_advantages(rewards, 4, valid, eps=0.0)
    s = math.sqrt(1 / 3)
    torch.testing.assert_close(adv, torch.tensor([1 / 3 / s, 0.0, -2 / 3 / s, 1 / 3 / s]), rtol=1e-6, atol=0)
    assert adv[1] == 0


@pytest.mark.parametrize("name", ESTIMATORS)
def test_group_with_single_valid_sample_is_zero(name):
    rewards = torch.tensor([5.0, 0.0, 0.0, 1.0, 0.0, 1.0])
    valid = torch.tensor([True, False, False, True, True, True])
    adv = get_advantage(name)(rewards, 3, valid)
    assert torch.equal(adv[:3], torch.zeros(3))
    assert adv[3:].abs().sum() > 0


@pytest.mark.parametrize("name", ESTIMATORS)
def test_group_size_one_is_a_clear_error(name):
    with pytest.raises(ValueError, match="group_size >= 2"):
        get_advantage(name)(torch.tensor([1.0, 0.0]), 1)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="do not split into groups"):
        grpo_advantages(torch.zeros(7), 2)
    with pytest.raises(ValueError, match="1-D"):
        grpo_advantages(torch.zeros(2, 4), 4)
    with pytest.raises(ValueError, match="non-finite"):
        grpo_advantages(torch.tensor([1.0, float("nan")]), 2)
    with pytest.raises(ValueError, match="bool tensor"):
        grpo_advantages(torch.zeros(4), 2, valid=torch.ones(4))
    with pytest.raises(TypeError, match="floating"):
        grpo_advantages(torch.zeros(4, dtype=torch.long), 2)


def test_registry():
    assert set(ESTIMATORS) <= set(ADVANTAGE_ESTIMATORS)
    assert get_advantage("gspo") is grpo_advantages
    with pytest.raises(ValueError, match="registered: .*grpo"):
        get_advantage("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("grpo")(dr_grpo_advantages)

    @register_advantage("test_constant")
    def constant(rewards, group_size, valid=None, *, value=1.0):
        return torch.full_like(rewards, value)

    try:
        out = get_advantage("test_constant")(torch.zeros(2), 2, value=3.0)
        assert torch.equal(out, torch.full((2,), 3.0))
    finally:
        ADVANTAGE_ESTIMATORS.pop("test_constant")


def test_sequence_to_token_advantages():
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]], dtype=torch.bool)
    out = sequence_to_token_advantages(adv, mask)
    assert torch.equal(out, torch.tensor([[2.0, 2.0, 0.0], [0.0, -1.0, -1.0]]))
    with pytest.raises(ValueError, match="advantages"):
        sequence_to_token_advantages(adv, mask[:1])
