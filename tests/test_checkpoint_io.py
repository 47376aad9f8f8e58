"""AtomicCheckpointIO and checkpoint_steps on real torch.save files: a missing, truncated, random or foreign file is
a clear error that says what to do."""

import os

import pytest
import torch

from orbit_lightning.checkpoint_io import AtomicCheckpointIO, checkpoint_steps


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "rl_step=3.ckpt"
    AtomicCheckpointIO().save_checkpoint({"global_step": 6, "orbit": {"rl_step": 3}, "w": torch.arange(4.0)}, path)
    return path


def test_round_trip_and_steps(saved):
    loaded = AtomicCheckpointIO().load_checkpoint(saved)
    assert loaded["global_step"] == 6 and torch.equal(loaded["w"], torch.arange(4.0))
    assert checkpoint_steps(saved) == (6, 3, 0)  # (0: optimizer steps per RL step not recorded, an older file)
    assert [p.name for p in saved.parent.iterdir()] == [saved.name]  # no temp file left beside it


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist; pass trainer.resume="):
        checkpoint_steps(tmp_path / "nope.ckpt")


@pytest.mark.parametrize("damage", ["truncated", "random"])
def test_unreadable_file(saved, damage):
    data = saved.read_bytes()
    saved.write_bytes(data[: len(data) // 2] if damage == "truncated" else os.urandom(len(data)))
    for read in (checkpoint_steps, AtomicCheckpointIO().load_checkpoint):
        with pytest.raises(ValueError, match=r"cannot be read: it is truncated, corrupt or not a torch checkpoint "
                                             r"\(not a whole zip archive, which torch.save writes\)\. "
                                             r".*trainer.resume=null"):
            read(saved)


def test_damage_inside_the_archive(saved):
    data = bytearray(saved.read_bytes())
    at = data.index(b"data.pkl") + 200  # into the pickle's stored bytes: the zip's directory stays whole
    data[at:at + 64] = bytes(64)
    saved.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"cannot be read: .*\(torch: [^\n]+\)\. Resume from another .ckpt"):
        AtomicCheckpointIO().load_checkpoint(saved)


def test_foreign_file(tmp_path):
    torch.save({"lora_A": torch.zeros(2)}, tmp_path / "adapter.pt")
    with pytest.raises(ValueError, match="is not a training checkpoint"):
        checkpoint_steps(tmp_path / "adapter.pt")
