import lightning as L
import pytest
import torch

from orbit_lightning.data import CharTokenizer, PromptDataModule, PromptDataset, ResumableBatchSampler

ROWS = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(10)]


def make_dm(**kw) -> PromptDataModule:
    tok = CharTokenizer()
    return PromptDataModule(PromptDataset(ROWS, tok), PromptDataset(ROWS[:3], tok), prompts_per_step=4, **kw)


def indices(batch) -> list[int]:
    return [item["index"] for item in batch]


def test_batches_are_lists_of_items_and_cover_each_epoch():
    it = iter(make_dm(seed=5).train_dataloader())
    batches = [next(it) for _ in range(5)]  # 20 items = exactly 2 epochs of 10
    assert all(isinstance(b, list) and len(b) == 4 for b in batches)
    assert set(batches[0][0]) == {"prompt_ids", "prompt", "answer", "metadata", "index"}
    flat = [i for b in batches for i in indices(b)]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert flat[:10] != flat[10:]  # reshuffled per epoch
    assert flat[:10] != list(range(10))


def test_resume_gives_the_same_next_batch():
    dm = make_dm(seed=3)
    it = iter(dm.train_dataloader())
    for _ in range(3):
        next(it)
    state = dm.state_dict()
    expected = [indices(next(it)) for _ in range(3)]  # crosses into the second epoch

    resumed = make_dm(seed=3)
    resumed.load_state_dict(state)
    it2 = iter(resumed.train_dataloader())
    assert [indices(next(it2)) for _ in range(3)] == expected


def test_state_checks_the_dataset():
    sampler = ResumableBatchSampler(10, 4, seed=3)
    with pytest.raises(ValueError, match="num_items: saved 11, now 10"):
        sampler.load_state_dict({**sampler.state_dict(), "num_items": 11})
    with pytest.raises(ValueError, match="empty"):
        ResumableBatchSampler(0, 4)


def test_eval_loader_is_ordered_and_unpadded():
    batches = list(make_dm().eval_dataloader())
    assert [indices(b) for b in batches] == [[0, 1, 2]]
    assert [len(x["prompt_ids"]) for x in batches[0]] == [5, 5, 5]


class RecordingModule(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(indices(batch))
        return (self.w * 0).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(max_steps: int, dm: PromptDataModule, ckpt_path=None) -> tuple[L.Trainer, RecordingModule]:
    trainer = L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    module = RecordingModule()
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
    return trainer, module


def test_resume_through_a_lightning_checkpoint(tmp_path):
    """Lightning pre-fetches one batch ahead; the checkpoint must still resume at the next untrained batch."""
    _, full = fit(5, make_dm(seed=1))
    trainer, first = fit(3, make_dm(seed=1))
    trainer.save_checkpoint(tmp_path / "step3.ckpt")
    _, second = fit(5, make_dm(seed=1), ckpt_path=tmp_path / "step3.ckpt")
    assert first.seen == full.seen[:3]
    assert second.seen == full.seen[3:]
