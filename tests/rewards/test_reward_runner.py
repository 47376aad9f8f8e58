import logging
import math
import time

import pytest
import torch

from orbit_lightning.rewards import RewardRunner


def exact(prompt, completion, metadata):
    return float(completion == metadata["answer"])


def length(prompt, completion, metadata):
    return len(completion)


def flaky(prompt, completion, metadata):
    """Fails in three different ways, on samples 1 (raise), 2 (hang) and 3 (NaN)."""
    if completion == "raise":
        raise RuntimeError("verifier crashed")
    if completion == "hang":
        time.sleep(1.0)
        return 1.0
    if completion == "nan":
        return math.nan
    return 2.0


def test_weighted_sum_per_function_and_dtypes():
    runner = RewardRunner([(exact, 1.0), (length, -0.5)], timeout_s=5, max_workers=3)
    result = runner(["q"] * 3, ["7", "12", "x"], [{"answer": "7"}, {"answer": "12"}, {"answer": "9"}])
    # hand-computed: 1 - 0.5*1, 1 - 0.5*2, 0 - 0.5*1
    assert result.rewards.dtype == torch.float32 and result.valid.dtype == torch.bool
    assert result.rewards.tolist() == [0.5, 0.0, -0.5]
    assert result.valid.all()
    assert result.per_function["exact"].tolist() == [1.0, 1.0, 0.0]
    assert result.per_function["length"].tolist() == [1.0, 2.0, 1.0]
    assert result.failures == []


def test_raise_timeout_nan_and_non_number_are_masked(caplog):
    completions = ["ok", "raise", "hang", "nan", "ok"]
    runner = RewardRunner([(flaky, 1.0), (length, 1.0)], timeout_s=0.2, max_workers=2)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="orbit_lightning.rewards.runner"):
        result = runner(["p"] * 5, completions, [{}] * 5)
    elapsed = time.monotonic() - start
    assert elapsed < 0.9, f"the hung call must be abandoned at the timeout, took {elapsed:.2f}s"
    assert result.valid.tolist() == [True, False, False, False, True]
    assert result.rewards.tolist() == [4.0, 0.0, 0.0, 0.0, 4.0]
    flaky_scores = result.per_function["flaky"]
    assert flaky_scores[[0, 4]].tolist() == [2.0, 2.0] and flaky_scores[1:4].isnan().all()
    # the other function still scored every sample
    assert result.per_function["length"].tolist() == [2.0, 5.0, 4.0, 3.0, 2.0]
    assert len(result.failures) == 3
    assert "flaky[sample 1]: RuntimeError: verifier crashed" in result.failures
    assert any(f.startswith("flaky[sample 2]: TimeoutError") for f in result.failures)
    assert any(f.startswith("flaky[sample 3]: ValueError") for f in result.failures)
    assert "3 of 10 reward calls failed" in caplog.text


def test_non_number_is_masked():
    runner = RewardRunner([(lambda p, c, m: "1.0", 1.0)], timeout_s=1, max_workers=1)
    result = runner(["p"], ["c"], [{}])
    assert not result.valid[0] and result.rewards[0] == 0
    assert "TypeError" in result.failures[0] and "str" in result.failures[0]


def test_hung_calls_do_not_starve_the_pool():
    # One worker, two hanging samples: each must get a replacement worker, so the rest still run.
    runner = RewardRunner([(flaky, 1.0)], timeout_s=0.2, max_workers=1)
    result = runner(["p"] * 4, ["hang", "hang", "ok", "ok"], [{}] * 4)
    assert result.valid.tolist() == [False, False, True, True]


def test_bad_specs_and_inputs():
    with pytest.raises(KeyError, match="registered: "):
        RewardRunner([("not_registered", 1.0)])
    with pytest.raises(ValueError, match="twice"):
        RewardRunner([(exact, 1.0), (exact, 2.0)])
    with pytest.raises(ValueError, match="weight"):
        RewardRunner([(exact, math.inf)])
    with pytest.raises(ValueError, match="same length"):
        RewardRunner([(exact, 1.0)])(["p"], ["a", "b"], [{}, {}])
