"""An endless, resumable stream of index batches: a seeded shuffle per epoch and one position counter."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any


class ResumableBatchSampler:
    """Yields lists of ``batch_size`` indices into ``range(num_items)`` forever.

    The whole state is ``cursor``, the number of indices handed out so far: epoch ``cursor // num_items``
    is permutation ``P(seed, epoch)``, so restoring the cursor restores the exact next batch. A batch may
    straddle two epochs (RL counts steps, not epochs, so no batch is dropped or short).
    """

    def __init__(self, num_items: int, batch_size: int, seed: int = 0, shuffle: bool = True) -> None:
        if num_items < 1:
            raise ValueError(f"cannot sample from {num_items} items; the dataset is empty")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.num_items, self.batch_size, self.seed, self.shuffle = num_items, batch_size, seed, shuffle
        self.cursor = 0
        self._epoch, self._order = -1, []

    def _order_for(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            self._order = list(range(self.num_items))
            if self.shuffle:
                # A string seed hashes stably across processes (unlike hash()), one stream per epoch.
                random.Random(f"orbit-prompts:{self.seed}:{epoch}").shuffle(self._order)
            self._epoch = epoch
        return self._order

    def next_batch(self) -> list[int]:
        batch = []
        for _ in range(self.batch_size):
            epoch, pos = divmod(self.cursor, self.num_items)
            batch.append(self._order_for(epoch)[pos])
            self.cursor += 1
        return batch

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self.next_batch()

    def state_dict(self, cursor: int | None = None) -> dict[str, Any]:
        """The state at ``cursor`` (default: the current one)."""
        return {
            "cursor": self.cursor if cursor is None else cursor,
            "num_items": self.num_items,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        changed = [k for k in ("num_items", "seed", "shuffle") if state.get(k) != mine[k]]
        if changed:
            diffs = ", ".join(f"{k}: saved {state.get(k)!r}, now {mine[k]!r}" for k in changed)
            raise ValueError(
                f"sampler state does not fit this dataset ({diffs}); resume with the same data and seed"
            )
        self.cursor = int(state["cursor"])
