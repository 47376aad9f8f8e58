"""The Lightning datamodule: endless, resumable batches of prompts for RL steps, plus an eval loader."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning as L
from torch.utils.data import DataLoader, IterableDataset

from orbit_lightning.data.prompts import PromptDataset
from orbit_lightning.data.sampler import ResumableBatchSampler


def _keep_list(batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Collate that keeps the item dicts as they are: prompts have different lengths and rollout pads."""
    return batch


class _PromptStream(IterableDataset):
    """Endless batches (lists of dataset items) in the order of the shared sampler.

    An IterableDataset because Lightning then leaves the sampling alone (it would otherwise swap in a
    DistributedSampler and lose the resumable state). Each rank gets the same stream.
    """

    def __init__(self, dataset: PromptDataset, sampler: ResumableBatchSampler) -> None:
        self.dataset, self.sampler = dataset, sampler

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        for indices in self.sampler:
            yield [self.dataset[i] for i in indices]


class PromptDataModule(L.LightningDataModule):
    """Train batches of ``prompts_per_step`` prompt items, forever; eval batches over ``eval_dataset`` once.

    The train order is a seeded shuffle per epoch; ``state_dict()``/``load_state_dict()`` carry the position,
    so a resumed run gets exactly the batch the interrupted run would have trained on next.
    """

    def __init__(
        self,
        train_dataset: PromptDataset,
        eval_dataset: PromptDataset | None = None,
        prompts_per_step: int = 8,
        eval_batch_size: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        super().__init__()
        if len(train_dataset) == 0:
            raise ValueError("PromptDataModule needs a non-empty train_dataset")
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.prompts_per_step = prompts_per_step
        self.eval_batch_size = eval_batch_size or prompts_per_step
        self.sampler = ResumableBatchSampler(len(train_dataset), prompts_per_step, seed, shuffle)
        # Cursor after the last batch that reached training_step (see state_dict).
        self._trained_cursor = self.sampler.cursor

    def train_dataloader(self) -> DataLoader:
        self._trained_cursor = self.sampler.cursor
        # num_workers=0: the sampler state lives in this process, and the items are already tokenized.
        return DataLoader(
            _PromptStream(self.train_dataset, self.sampler), batch_size=None, collate_fn=_keep_list
        )

    # Not Lightning's `val_dataloader`: evaluation is generation (callbacks.EvalCallback), not a validation_step, and
    # Lightning warns about a validation loader without one.
    def eval_dataloader(self) -> DataLoader | list:
        if self.eval_dataset is None:
            return []
        return DataLoader(
            self.eval_dataset, batch_size=self.eval_batch_size, shuffle=False, collate_fn=_keep_list
        )

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        # Lightning calls this once per batch that goes on to training_step, never for pre-fetched ones.
        if self.trainer is not None and self.trainer.training:
            self._trained_cursor += len(batch)
        return batch

    def state_dict(self) -> dict[str, Any]:
        # Lightning's loop pre-fetches the next batch before training_step runs on the current one, so under a
        # Trainer the sampler is one batch ahead of training; save the position training reached, and the
        # pre-fetched batch is served again after resume. Standalone, every batch drawn counts as used.
        # (Needs the usual training_step(batch, batch_idx); the dataloader_iter form skips this hook.)
        cursor = self._trained_cursor if self.trainer is not None else None
        return {"sampler": self.sampler.state_dict(cursor)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "sampler" not in state_dict:
            raise KeyError(f"PromptDataModule state needs a 'sampler' entry, got keys {sorted(state_dict)}")
        self.sampler.load_state_dict(state_dict["sampler"])
        self._trained_cursor = self.sampler.cursor
