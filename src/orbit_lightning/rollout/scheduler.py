"""Continuous batching over the paged KV cache: who decodes, who is prefilled, who is preempted, each step.

Each step, oldest first:
1. every running sequence reserves the cache slots of its next `lookahead` tokens (a new block at a block
   boundary, or a private copy of a shared last block: copy-on-write). A lookahead > 1 (multi-step decode) is
   granted only when the free blocks cover it for every running sequence; otherwise the step decodes one
   token. When no block is free, the *youngest* running sequence is preempted: its blocks are released and it
   goes back to the waiting queue, to be recomputed (prompt + tokens so far, one prefill) when blocks free up.
   Its generator and tokens are kept, so its output does not depend on having been preempted.
2. if nothing was preempted, waiting sequences are admitted in arrival order while the batch has room, the
   prefill token budget allows and the blocks they hold after their first decode are free. The `n` fresh
   samples of a prompt are admitted together: one is prefilled, the others share its blocks.

The oldest sequence is never a victim while another runs, and the engine only accepts requests whose every
sample fits the cache alone, so every request finishes.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from .blocks import BlockAllocator, blocks_for
from .sequence import Sequence


@dataclass
class PrefillJob:
    leader: Sequence  # computed: all its tokens
    followers: list[Sequence] = field(default_factory=list)  # fresh siblings that share the leader's blocks

    @property
    def samples(self) -> list[Sequence]:
        return [self.leader, *self.followers]


@dataclass
class StepPlan:
    prefill: list[PrefillJob]
    decode: list[Sequence]
    copies: list[tuple[int, int]]  # copy-on-write (src block, dst block), to run before any forward
    preempted: list[Sequence]
    lookahead: int = 1  # decode tokens per sequence this step (their cache slots are reserved)


class Scheduler:
    def __init__(self, allocator: BlockAllocator, block_size: int, max_batch_size: int, max_prefill_tokens: int):
        self.allocator, self.block_size = allocator, block_size
        self.max_batch_size, self.max_prefill_tokens = max_batch_size, max_prefill_tokens
        self.waiting: list[Sequence] = []  # sorted by priority (oldest first)
        self.running: list[Sequence] = []  # sorted by priority
        self.num_preemptions = 0

    def add(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            bisect.insort(self.waiting, s, key=lambda x: x.priority)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, lookahead: int = 1) -> StepPlan:
        """Plan one step; `lookahead` > 1 asks for that many decode tokens per running sequence (granted only if
        no sequence must be preempted for it)."""
        copies: list[tuple[int, int]] = []
        preempted: list[Sequence] = []
        decode: list[Sequence] = []
        if lookahead > 1 and self._new_blocks(lookahead) > self.allocator.num_free:
            lookahead = 1
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            while not self._reserve_slots(seq, lookahead, copies):
                victim = self.running[-1]  # the youngest
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                decode.append(seq)
                i += 1
        prefill = [] if preempted else self._admit()
        if self.waiting and not self.running and not preempted:
            raise RuntimeError(f"scheduler stalled: {len(self.waiting)} waiting sequence(s) cannot start on an "
                               f"empty cache of {self.allocator.num_usable} blocks (an admission check is wrong)")
        return StepPlan(prefill, decode, copies, preempted, lookahead if decode else 1)

    def finish(self, seq: Sequence) -> None:
        """Release a finished (or aborted) sequence's blocks and drop it from the queues."""
        self.allocator.release(seq.block_table)
        seq.block_table = []
        for queue in (self.running, self.waiting):
            if seq in queue:
                queue.remove(seq)

    # ---- internals ---------------------------------------------------------------------------------

    def _blocks_touched(self, seq: Sequence, count: int) -> range:
        """Indices into seq's block table of the blocks that receive its tokens num_cached .. + count - 1."""
        return range(seq.num_cached // self.block_size, (seq.num_cached + count - 1) // self.block_size + 1)

    def _new_blocks(self, count: int) -> int:
        """Blocks the running sequences would take to reserve their next `count` slots (new or copied)."""
        return sum(1 for seq in self.running for idx in self._blocks_touched(seq, count)
                   if idx >= len(seq.block_table) or self.allocator.is_shared(seq.block_table[idx]))

    def _reserve_slots(self, seq: Sequence, count: int, copies: list[tuple[int, int]]) -> bool:
        """Make the blocks that receive seq's next `count` tokens writable by `seq` alone; False if out of blocks
        (blocks reserved so far stay in its table)."""
        for idx in self._blocks_touched(seq, count):
            if idx < len(seq.block_table) and not self.allocator.is_shared(seq.block_table[idx]):
                continue
            if self.allocator.num_free == 0:
                return False
            (new,) = self.allocator.allocate(1)
            if idx < len(seq.block_table):  # shared, partially filled: copy, then drop our reference to the original
                old = seq.block_table[idx]
                copies.append((old, new))
                self.allocator.release([old])
                seq.block_table[idx] = new
            else:
                seq.block_table.append(new)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.allocator.release(seq.block_table)
        seq.block_table, seq.num_cached = [], 0
        self.num_preemptions += 1
        self.add([seq])

    def _blocks_to_start(self, num_tokens: int, samples: int) -> int:
        """Blocks a prefill of `num_tokens` shared by `samples` holds after each sample's first decode: the
        prompt's blocks plus, per sample, a new block (full last block) or a private copy (partial one, which
        the first sample may keep). For one sample this is blocks_for(num_tokens + 1)."""
        return blocks_for(num_tokens, self.block_size) + samples - (1 if num_tokens % self.block_size else 0)

    def _admit(self) -> list[PrefillJob]:
        jobs: list[PrefillJob] = []
        longest = 0
        while self.waiting:
            room = self.max_batch_size - len(self.running)
            if room <= 0:
                break
            group = self._fresh_siblings(self.waiting[0], room)
            lead = group[0]
            # A group larger than the whole cache would never start: split it (siblings prefill later, unshared).
            usable = self.allocator.num_usable
            while len(group) > 1 and self._blocks_to_start(len(lead.tokens), len(group)) > usable:
                group.pop()
            need = self._blocks_to_start(len(lead.tokens), len(group))
            padded = (len(jobs) + 1) * max(longest, len(lead.tokens))  # prefill is padded to the longest row
            if need > self.allocator.num_free or (jobs and padded > self.max_prefill_tokens):
                break
            lead.block_table = self.allocator.allocate(blocks_for(len(lead.tokens), self.block_size))
            for f in group[1:]:
                f.block_table = self.allocator.share(lead.block_table)
            del self.waiting[: len(group)]
            for s in group:
                bisect.insort(self.running, s, key=lambda x: x.priority)
            jobs.append(PrefillJob(lead, group[1:]))
            longest = max(longest, len(lead.tokens))
        return jobs

    def _fresh_siblings(self, head: Sequence, room: int) -> list[Sequence]:
        """`head` plus the following waiting samples of the same request that have not started either."""
        if head.started:
            return [head]
        group = [head]
        for s in self.waiting[1:room]:
            if s.request is not head.request or s.started:
                break
            group.append(s)
        return group
