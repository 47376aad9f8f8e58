"""DAPO dynamic sampling: group keep-mask and accumulation of kept groups over rounds."""

import pytest
import torch

from orbit_lightning.algorithms import concat_kept_groups, group_keep_mask

NAN = float("nan")


def test_group_keep_mask_hand_computed():
    rewards = torch.tensor(
        [
            1.0, 1.0, 1.0,  # all equal -> drop
            0.0, 1.0, 0.0,  # spread 1 -> keep
            0.5, 0.5, 0.5 + 1e-8,  # spread below tol -> drop
            1.0, NAN, 0.0,  # invalid middle sample ignored, spread 1 -> keep
            1.0, 0.0, NAN,  # only one valid sample -> drop
        ],
        dtype=torch.float64,  # float32 would round 0.5 + 1e-8 to 0.5
    )  # fmt: skip
    valid = torch.isfinite(rewards)
    valid[13] = False
    keep = group_keep_mask(rewards, 3, valid)
    assert keep.tolist() == [False, True, False, True, False]
    assert group_keep_mask(rewards[:9], 3, tol=0.0).tolist() == [False, True, True]
    with pytest.raises(ValueError, match="tol"):
        group_keep_mask(rewards[:9], 3, tol=-1.0)


def _round(first_id, B, G, T):
    ids = torch.arange(first_id, first_id + B * G)
    return {
        "sample_id": ids,
        "tokens": ids[:, None].repeat(1, T),
        "mask": torch.ones(B * G, T, dtype=torch.bool),
    }


def test_concat_kept_groups_pads_and_stops_at_target():
    G = 2
    r1 = _round(0, B=3, G=G, T=2)  # groups hold samples {0,1}, {2,3}, {4,5}
    r2 = _round(100, B=2, G=G, T=4)  # groups {100,101}, {102,103}
    keeps = [torch.tensor([False, True, True]), torch.tensor([True, True])]
    batch, n = concat_kept_groups([r1, r2], keeps, G, target_groups=3, pad_values={"tokens": -1})
    assert n == 3
    assert batch["sample_id"].tolist() == [2, 3, 4, 5, 100, 101]
    assert batch["tokens"].tolist() == [
        [2, 2, -1, -1], [3, 3, -1, -1], [4, 4, -1, -1], [5, 5, -1, -1],
        [100] * 4, [101] * 4,
    ]  # fmt: skip
    assert batch["mask"].dtype == torch.bool
    assert batch["mask"].sum(-1).tolist() == [2, 2, 2, 2, 4, 4]


def test_concat_kept_groups_reports_shortfall():
    r1 = _round(0, B=2, G=3, T=1)
    batch, n = concat_kept_groups([r1], [torch.tensor([True, False])], 3, target_groups=4)
    assert n == 1 and batch["sample_id"].tolist() == [0, 1, 2]
    batch, n = concat_kept_groups([r1], [torch.tensor([False, False])], 3, target_groups=4)
    assert n == 0 and batch["tokens"].shape == (0, 1)


def test_concat_kept_groups_errors():
    r1 = _round(0, B=2, G=2, T=1)
    keep = torch.tensor([True, True])
    with pytest.raises(ValueError, match="keys"):
        concat_kept_groups([r1, {"sample_id": r1["sample_id"]}], [keep, keep], 2, 2)
    with pytest.raises(ValueError, match="rows"):
        concat_kept_groups([r1], [keep], 3, 2)
    with pytest.raises(ValueError, match="one keep mask per round"):
        concat_kept_groups([r1], [], 2, 2)
    with pytest.raises(ValueError, match="bool"):
        concat_kept_groups([r1], [keep.long()], 2, 2)
    with pytest.raises(ValueError, match="target_groups"):
        concat_kept_groups([r1], [keep], 2, 0)
