"""KV block allocator with a prefix cache.

A full block is cached under a chained hash of its prefix once its KV is computed; freed
blocks stay reusable until the allocator takes them back, least recently freed first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import count

from tapserve.coordinator.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0


def chain_hash(prev_hash: int | None, tokens: tuple[int, ...]) -> int:
    return hash((prev_hash, tokens))


@dataclass
class BlockManager:
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    blocks: list[Block] = field(init=False)
    free: OrderedDict[int, None] = field(init=False)  # block ids with ref_count 0, LRU first
    cached: dict[int, int] = field(init=False)  # hash -> block id
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    # stamps for Sequence.block_table_version: equal stamps mean the same table
    _table_stamps: Iterator[int] = field(init=False, default_factory=lambda: count(1))

    def __post_init__(self) -> None:
        if self.num_blocks <= 0 or self.block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self.free = OrderedDict((i, None) for i in range(self.num_blocks))
        self.cached = {}

    # ---- queries -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Sequence, reuse_cap: int | None = None) -> bool:
        hits = self._lookup(seq, reuse_cap)
        hit_free = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return self.blocks_needed(seq.num_tokens) - len(hits) <= self.num_free_blocks - hit_free

    def can_append(self, seqs: list[Sequence]) -> bool:
        return sum(self.blocks_to_append(s) for s in seqs) <= self.num_free_blocks

    def blocks_to_append(self, seq: Sequence) -> int:
        """Fresh blocks append_slot(seq) takes: a copy of a shared block, a new last block."""
        table, size = seq.block_table, self.block_size
        i = seq.num_computed_tokens // size
        shared = i < len(table) and self.blocks[table[i]].ref_count > 1
        return shared + (len(seq.token_ids) > len(table) * size)

    # ---- allocation ----------------------------------------------------------------
    def allocate(self, seq: Sequence, reuse_cap: int | None = None) -> int:
        """Give a waiting sequence blocks for all its tokens, reusing cached prefix blocks.
        Returns the number of tokens whose KV came from the cache."""
        assert not seq.block_table
        hits = self._lookup(seq, reuse_cap)
        for block_id in hits:
            self._take(block_id)
        seq.block_table = list(hits)
        seq.num_hashed_blocks = len(hits)
        while len(seq.block_table) < self.blocks_needed(seq.num_tokens):
            seq.block_table.append(self._take_fresh())
        self._restamp(seq)
        num_cached = len(hits) * self.block_size
        seq.num_computed_tokens = num_cached
        if self.enable_prefix_caching:
            self.stats.queried_tokens += seq.num_tokens
            self.stats.hit_tokens += num_cached
        return num_cached

    def append_slot(self, seq: Sequence) -> tuple[int, int] | None:
        """Make room for the sequence's newest token, copying a block shared with a fork
        first; the returned (src, dst) copy must run on every rank before the next forward."""
        copy = None
        i = self._shared_write_block(seq)
        if i is not None:
            src, dst = seq.block_table[i], self._take_fresh()
            self.blocks[src].ref_count -= 1  # still >= 1: the other sharers keep it
            seq.block_table[i] = dst
            self._restamp(seq)
            copy = (src, dst)
        if self._needs_new_block(seq):
            seq.block_table.append(self._take_fresh())
            self._restamp(seq, appended=True)
        return copy

    def append_block(self, seq: Sequence) -> None:
        """Give seq one more, unshared block at the end of its table (a steady decode row)."""
        seq.block_table.append(self._take_fresh())
        self._restamp(seq, appended=True)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share all of parent's blocks with child; allocates nothing (see append_slot)."""
        child.block_table = list(parent.block_table)
        self._restamp(child)
        for block_id in child.block_table:
            self.blocks[block_id].ref_count += 1

    def free_sequence(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free[block_id] = None
        seq.block_table = []
        self._restamp(seq)
        seq.num_hashed_blocks = 0

    def register_computed(self, seq: Sequence) -> None:
        """Enter newly completed full blocks of seq into the prefix cache."""
        num_full = seq.num_computed_tokens // self.block_size
        if not self.enable_prefix_caching or num_full <= seq.num_hashed_blocks:
            return  # nothing new (the usual decode step)
        prev = (
            self.blocks[seq.block_table[seq.num_hashed_blocks - 1]].hash
            if seq.num_hashed_blocks
            else None
        )
        for i in range(seq.num_hashed_blocks, num_full):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            prev = chain_hash(prev, tokens)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and prev not in self.cached:
                block.hash, block.token_ids = prev, tokens
                self.cached[prev] = block.block_id
            elif block.hash is None:
                block.hash = prev  # an equal block is cached already; keep the chain going
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, num_full)

    # ---- internals -----------------------------------------------------------------
    def _lookup(self, seq: Sequence, reuse_cap: int | None) -> list[int]:
        """Cached blocks covering a prefix of seq; the last token is always recomputed."""
        if not self.enable_prefix_caching:
            return []
        limit = seq.num_tokens - 1 if reuse_cap is None else min(seq.num_tokens - 1, reuse_cap)
        hits, prev = [], None
        for i in range(max(limit, 0) // self.block_size):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            prev = chain_hash(prev, tokens)
            block_id = self.cached.get(prev)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
        return hits

    def _restamp(self, seq: Sequence, appended: bool = False) -> None:
        """seq's block table changed; appended: only by blocks added at its end."""
        seq.block_table_base = seq.block_table_version if appended else -1
        seq.block_table_version = next(self._table_stamps)

    def _needs_new_block(self, seq: Sequence) -> bool:
        return seq.num_tokens > len(seq.block_table) * self.block_size

    def _shared_write_block(self, seq: Sequence) -> int | None:
        """Index of the block seq's next computed token goes into, if another sequence shares it."""
        i = seq.num_computed_tokens // self.block_size
        if i < len(seq.block_table) and self.blocks[seq.block_table[i]].ref_count > 1:
            return i
        return None

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _take_fresh(self) -> int:
        if not self.free:
            raise RuntimeError("out of KV blocks")
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.cached.get(block.hash) == block_id:
            del self.cached[block.hash]  # evict: the block is about to hold other tokens
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block_id

    def check_invariants(self) -> None:
        """free + referenced == total; free blocks have ref 0; cache points at valid blocks."""
        referenced = sum(1 for b in self.blocks if b.ref_count > 0)
        assert referenced + len(self.free) == self.num_blocks, "block accounting broken"
        assert all(self.blocks[b].ref_count == 0 for b in self.free)
        assert all(self.blocks[b].hash == h for h, b in self.cached.items())
