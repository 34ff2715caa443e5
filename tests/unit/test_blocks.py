"""Unit tests of coordinator/blocks.py: allocation accounting, the prefix cache (chained
hashes with a token check, the last prompt token always recomputed, reuse caps), LRU
eviction of free cached blocks, and sharing between forked sequences."""

from __future__ import annotations

import pytest

import tapserve.coordinator.blocks as blocks_module
from tapserve.api.sampling_params import SamplingParams
from tapserve.coordinator.blocks import BlockManager
from tapserve.coordinator.sequence import Request, Sequence, SequenceFactory

BS = 4


@pytest.fixture
def factory():
    return SequenceFactory()


def new_seq(factory: SequenceFactory, tokens: list[int]) -> Sequence:
    request = Request(f"r{id(tokens)}", list(tokens), SamplingParams(), arrival_order=0)
    return factory.prompt_sequence(request)


def compute(bm: BlockManager, seq: Sequence, upto: int | None = None) -> None:
    """Pretend the model ran: all (or `upto`) tokens computed, full blocks registered."""
    seq.num_computed_tokens = seq.num_tokens if upto is None else upto
    bm.register_computed(seq)


def referenced(bm: BlockManager) -> int:
    return sum(1 for b in bm.blocks if b.ref_count > 0)


def test_allocate_and_free_account_every_block(factory) -> None:
    bm = BlockManager(8, BS)
    a = new_seq(factory, list(range(10)))  # 3 blocks
    assert bm.blocks_needed(10) == 3 and bm.blocks_needed(12) == 3 and bm.blocks_needed(13) == 4
    assert bm.allocate(a) == 0
    assert len(a.block_table) == 3 and len(set(a.block_table)) == 3
    assert bm.num_free_blocks == 5 and referenced(bm) == 3
    bm.check_invariants()
    bm.free_sequence(a)
    assert bm.num_free_blocks == 8 and a.block_table == []
    bm.check_invariants()


def test_append_slot_only_at_block_boundaries(factory) -> None:
    bm = BlockManager(8, BS)
    seq = new_seq(factory, list(range(4)))
    bm.allocate(seq)
    assert len(seq.block_table) == 1
    seq.token_ids.append(99)  # token 5 needs a second block
    assert bm.can_append([seq])
    bm.append_slot(seq)
    assert len(seq.block_table) == 2
    for t in range(3):  # tokens 6..8 fit in block 2
        seq.token_ids.append(t)
        bm.append_slot(seq)
    assert len(seq.block_table) == 2
    bm.free_sequence(seq)
    assert bm.num_free_blocks == 8


def test_prefix_hit_after_registration(factory) -> None:
    bm = BlockManager(16, BS)
    a = new_seq(factory, list(range(13)))
    bm.allocate(a)
    compute(bm, a)  # 3 full blocks registered
    b = new_seq(factory, list(range(12)) + [77, 78])
    assert bm.allocate(b) == 12
    assert b.block_table[:3] == a.block_table[:3] and b.num_computed_tokens == 12
    assert all(bm.blocks[i].ref_count == 2 for i in a.block_table[:3])
    assert bm.stats.hit_tokens == 12 and bm.stats.queried_tokens == 13 + 14
    bm.free_sequence(a)
    bm.free_sequence(b)
    assert bm.num_free_blocks == 16
    bm.check_invariants()


def test_nothing_cached_before_it_is_computed(factory) -> None:
    bm = BlockManager(16, BS)
    a = new_seq(factory, list(range(12)))
    bm.allocate(a)
    compute(bm, a, upto=5)  # only block 0 is full and computed
    b = new_seq(factory, list(range(13)))
    assert bm.allocate(b) == 4


def test_last_prompt_token_is_always_recomputed(factory) -> None:
    bm = BlockManager(16, BS)
    a = new_seq(factory, list(range(12)))
    bm.allocate(a)
    compute(bm, a)
    same = new_seq(factory, list(range(12)))
    assert bm.allocate(same) == 8  # not 12: the last token's logits are needed
    one_more = new_seq(factory, list(range(13)))
    assert bm.allocate(one_more) == 12


def test_reuse_cap(factory) -> None:
    bm = BlockManager(16, BS)
    a = new_seq(factory, list(range(17)))
    bm.allocate(a)
    compute(bm, a)
    assert bm.allocate(new_seq(factory, list(range(17))), reuse_cap=9) == 8
    assert bm.allocate(new_seq(factory, list(range(17))), reuse_cap=0) == 0
    assert bm.allocate(new_seq(factory, list(range(17))), reuse_cap=100) == 16


def test_hash_is_chained(factory) -> None:
    """Block 1 of b has a's block-1 tokens, after a different block 0: no hit."""
    bm = BlockManager(16, BS)
    a = new_seq(factory, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.allocate(a)
    compute(bm, a)
    b = new_seq(factory, [0, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.allocate(b) == 0


def test_token_check_guards_against_hash_collisions(factory, monkeypatch) -> None:
    monkeypatch.setattr(blocks_module, "chain_hash", lambda prev, tokens: 42)
    bm = BlockManager(16, BS)
    a = new_seq(factory, [1, 2, 3, 4, 5])
    bm.allocate(a)
    compute(bm, a)
    b = new_seq(factory, [9, 9, 9, 9, 5])  # same (fake) hash, other tokens
    assert bm.allocate(b) == 0
    c = new_seq(factory, [1, 2, 3, 4, 6])
    assert bm.allocate(c) == 4


def test_prefix_caching_disabled(factory) -> None:
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    a = new_seq(factory, list(range(9)))
    bm.allocate(a)
    compute(bm, a)
    assert bm.allocate(new_seq(factory, list(range(9)))) == 0
    assert not bm.cached and bm.stats.queried_tokens == 0


def test_freed_cached_blocks_stay_reusable_until_needed(factory) -> None:
    bm = BlockManager(4, BS)
    a = new_seq(factory, list(range(9)))  # 3 blocks, 2 full
    bm.allocate(a)
    compute(bm, a)
    bm.free_sequence(a)
    assert bm.num_free_blocks == 4
    b = new_seq(factory, list(range(8)) + [50])
    assert bm.can_allocate(b)
    assert bm.allocate(b) == 8
    assert bm.num_free_blocks == 1
    bm.free_sequence(b)
    bm.check_invariants()


def test_can_allocate_counts_free_cached_hits(factory) -> None:
    """A hit on a free cached block takes that block out of the free list."""
    bm = BlockManager(3, BS)
    a = new_seq(factory, list(range(9)))
    bm.allocate(a)
    compute(bm, a)
    bm.free_sequence(a)
    fits = new_seq(factory, list(range(12)))  # 2 hits + 1 fresh = 3 blocks
    assert bm.can_allocate(fits)
    too_big = new_seq(factory, list(range(8)) + [60] * 5)  # 2 hits + 2 fresh > 3
    assert not bm.can_allocate(too_big)


def cached_tokens(bm: BlockManager, factory, tokens: list[int]) -> int:
    """How many leading tokens of `tokens` the cache would supply (allocating nothing)."""
    return len(bm._lookup(new_seq(factory, tokens), None)) * BS


def test_eviction_is_lru_and_from_the_tail(factory) -> None:
    """Freed blocks go to the end of the free list, a sequence's last block first; fresh
    blocks come from the front. So never-used blocks go first, then the least recently
    freed sequence, from its tail (its prefix survives longest)."""
    bm = BlockManager(9, BS)
    a = new_seq(factory, list(range(100, 109)))  # 3 blocks, 2 full
    b = new_seq(factory, list(range(200, 209)))  # 3 blocks, 2 full
    for s in (a, b):
        bm.allocate(s)
        compute(bm, s)
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    unused = [i for i in range(9) if i not in a_blocks + b_blocks]
    bm.free_sequence(a)
    bm.free_sequence(b)
    assert list(bm.free) == unused + a_blocks[::-1] + b_blocks[::-1]
    assert cached_tokens(bm, factory, list(range(100, 110))) == 8
    c = new_seq(factory, list(range(300, 318)))  # 5 fresh blocks: 3 unused, then a's tail
    bm.allocate(c)
    assert c.block_table == unused + [a_blocks[2], a_blocks[1]]
    assert cached_tokens(bm, factory, list(range(100, 110))) == 4  # a's block 0 survived
    assert cached_tokens(bm, factory, list(range(200, 210))) == 8  # b untouched
    bm.free_sequence(c)
    bm.check_invariants()


def test_hit_on_a_free_cached_block_takes_it_out_of_the_free_list(factory) -> None:
    bm = BlockManager(4, BS)
    a = new_seq(factory, list(range(5)))
    bm.allocate(a)
    compute(bm, a)
    first = a.block_table[0]
    bm.free_sequence(a)
    assert first in bm.free
    b = new_seq(factory, list(range(5)))
    assert bm.allocate(b) == 4
    assert b.block_table[0] == first and first not in bm.free
    assert bm.blocks[first].ref_count == 1
    bm.free_sequence(b)
    assert bm.num_free_blocks == 4


def test_out_of_blocks_is_an_error(factory) -> None:
    bm = BlockManager(2, BS)
    seq = new_seq(factory, list(range(12)))
    assert not bm.can_allocate(seq)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate(seq)


def test_double_free_is_caught(factory) -> None:
    bm = BlockManager(4, BS)
    seq = new_seq(factory, list(range(5)))
    bm.allocate(seq)
    table = list(seq.block_table)
    bm.free_sequence(seq)
    seq.block_table = table
    with pytest.raises(AssertionError, match="freed twice"):
        bm.free_sequence(seq)


@pytest.mark.parametrize("num_tokens", [8, 10])
def test_fork_shares_full_blocks(factory, num_tokens) -> None:
    """A forked child references the parent's blocks; only the partly filled last block
    gets a private copy (when either of them writes into it); every block comes back."""
    bm = BlockManager(10, BS)
    parent = new_seq(factory, list(range(num_tokens)))
    bm.allocate(parent)
    compute(bm, parent)
    full = num_tokens // BS
    partial = parent.block_table[full] if num_tokens % BS else None
    children = [factory.fork(parent, i) for i in (1, 2, 3)]
    copies = [bm.fork(parent, c) for c in children]
    for seq in [parent] + children:  # each appends its next token
        seq.token_ids.append(7)
        copy = bm.append_slot(seq)
        if copy is not None:
            copies.append(copy)
    copies = [c for c in copies if c is not None]
    tables = [s.block_table for s in [parent] + children]
    assert all(t[:full] == parent.block_table[:full] for t in tables)
    assert all(bm.blocks[b].ref_count == 4 for b in parent.block_table[:full])
    tails = [b for t in tables for b in t[full:]]
    assert len(tails) == 4 and len(set(tails)) == 4
    # a partial last block is copied for three of the four writers, a full one never
    assert len(copies) == (3 if partial is not None else 0)
    assert all(src == partial and dst in tails and dst != partial for src, dst in copies)
    assert referenced(bm) == full + 4
    bm.check_invariants()
    for seq in [parent] + children:
        bm.free_sequence(seq)
    assert bm.num_free_blocks == 10
    bm.check_invariants()
