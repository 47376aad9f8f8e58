import sys

import pytest

from orbit_lightning.registry import UnknownNameError
from orbit_lightning.rewards import REWARDS, RewardRunner, get_reward, register_reward


@pytest.fixture
def scratch_name():
    name = "test_registry_length_reward"
    yield name
    REWARDS.pop(name, None)


def test_builtins_are_registered():
    for name in ("math_exact", "format", "arithmetic_exact", "code_tests"):
        assert callable(get_reward(name))


def test_user_reward_registers_and_runs_by_name(scratch_name):
    @register_reward(scratch_name)
    def length(prompt, completion, metadata):
        return len(completion)

    assert get_reward(scratch_name) is length
    result = RewardRunner([(scratch_name, 0.5)], timeout_s=5, max_workers=2)(
        ["p", "p"], ["abc", ""], [{}, {}]
    )
    assert result.rewards.tolist() == [1.5, 0.0]


def test_unknown_name_lists_registered(scratch_name):
    with pytest.raises(KeyError) as err:
        get_reward("no_such_reward")
    assert "no_such_reward" in str(err.value) and "math_exact" in str(err.value)


def test_duplicate_name_needs_overwrite(scratch_name):
    register_reward(scratch_name)(lambda p, c, m: 0.0)
    with pytest.raises(ValueError, match="already registered"):
        register_reward(scratch_name)(lambda p, c, m: 1.0)
    replacement = register_reward(scratch_name, overwrite=True)(lambda p, c, m: 1.0)
    assert get_reward(scratch_name) is replacement


def test_a_reward_by_import_path_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "cwd_rewards_mod.py").write_text("def half(prompt, completion, metadata):\n    return 0.5\n")
    monkeypatch.chdir(tmp_path)
    path_before = list(sys.path)
    fn = get_reward("cwd_rewards_mod:half")
    assert fn("p", "c", {}) == 0.5 and sys.path == path_before  # the directory joined sys.path for the import only
    with pytest.raises(UnknownNameError, match=r"cwd_rewards_mod' \(.*cwd_rewards_mod.py\) has no function 'nope'"):
        get_reward("cwd_rewards_mod:nope")
    with pytest.raises(UnknownNameError, match="cannot import 'no_such_reward_module'"):
        get_reward("no_such_reward_module:fn")
