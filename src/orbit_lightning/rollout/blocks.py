"""Block bookkeeping for the paged KV cache: a free list and reference counts (host-side, no tensors).

A sequence owns a block table: the ids of the blocks that hold its tokens, `block_size` tokens each. Samples of
one prompt share the prompt's blocks (reference count > 1); a shared block is copied before it is written
(copy-on-write), which can only happen to the partially filled last prompt block.
"""

from __future__ import annotations

NULL_BLOCK = 0  # never handed out: padding tokens write into it and block tables are padded with it
NULL_SLOT = 0  # flat cache slot 0 = offset 0 of the null block: where padding tokens write their k/v


class OutOfBlocks(RuntimeError):
    pass


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockAllocator:
    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.refcount = [0] * num_blocks
        self._free = list(range(num_blocks - 1, NULL_BLOCK, -1))  # pop() hands out low ids first

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_usable - self.num_free

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"{n} KV blocks requested, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self.refcount[b] = 1
        return out

    def share(self, table: list[int]) -> list[int]:
        """Another owner for every block of `table` -> a copy of the table."""
        for b in table:
            self.refcount[b] += 1
        return list(table)

    def release(self, table: list[int]) -> None:
        for b in table:
            if self.refcount[b] <= 0:
                raise RuntimeError(f"KV block {b} released more often than it was allocated")
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                self._free.append(b)

    def is_shared(self, block: int) -> bool:
        return self.refcount[block] > 1
