"""Block manager behaviour: allocation, reference counts, prefix caching and decoding.

Unit tests pin each rule; a Hypothesis state machine drives random allocate / append /
free sequences and checks the bookkeeping invariants after every step.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sluice.engine import (
    BlockAllocationError,
    BlockManager,
    BlockTableError,
    Sequence,
    compute_block_hash,
)

BLOCK_SIZE = 4


def make_seq(seq_id: int, token_ids: list[int], block_size: int = BLOCK_SIZE) -> Sequence:
    return Sequence(seq_id, token_ids, block_size)


def ref_counts(manager: BlockManager) -> dict[int, int]:
    return {block.block_id: block.ref_count for block in manager.blocks if block.ref_count}


# -- Sequence --------------------------------------------------------------------------


def test_sequence_splits_tokens_into_logical_blocks() -> None:
    seq = make_seq(0, list(range(10)))
    assert seq.num_tokens == 10
    assert seq.num_blocks == 3
    assert seq.last_block_num_tokens == 2
    assert seq.block(0) == [0, 1, 2, 3]
    assert seq.block(2) == [8, 9]
    seq.append_token(10)
    seq.append_token(11)
    assert seq.last_block_num_tokens == 4
    assert seq.num_blocks == 3
    assert seq.num_completion_tokens == 2
    with pytest.raises(IndexError):
        seq.block(3)


def test_sequence_rejects_empty_prompt_and_bad_block_size() -> None:
    with pytest.raises(ValueError, match="at least one prompt token"):
        make_seq(0, [])
    with pytest.raises(ValueError, match="block_size"):
        make_seq(0, [1], block_size=0)


# -- construction and allocation -------------------------------------------------------


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 4), (4, 0), (-1, 4)])
def test_manager_rejects_sizes_below_one(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        BlockManager(num_blocks, block_size)


def test_allocate_then_free_restores_every_free_block() -> None:
    manager = BlockManager(8, BLOCK_SIZE)
    seq = make_seq(0, list(range(10)))
    manager.allocate(seq)
    assert len(seq.block_table) == 3
    assert len(set(seq.block_table)) == 3
    assert manager.num_free_blocks == 5
    assert manager.num_used_blocks == 3
    assert ref_counts(manager) == dict.fromkeys(seq.block_table, 1)
    manager.free(seq)
    assert seq.block_table == []
    assert seq.num_cached_tokens == 0
    assert manager.num_free_blocks == 8
    assert manager.num_used_blocks == 0
    assert ref_counts(manager) == {}


def test_allocate_twice_raises_block_table_error() -> None:
    manager = BlockManager(8, BLOCK_SIZE)
    seq = make_seq(0, [1, 2, 3])
    manager.allocate(seq)
    with pytest.raises(BlockTableError, match="already has a block table"):
        manager.allocate(seq)


def test_allocate_without_room_raises_and_changes_nothing() -> None:
    manager = BlockManager(2, BLOCK_SIZE)
    seq = make_seq(0, list(range(9)))
    assert not manager.can_allocate(seq)
    with pytest.raises(BlockAllocationError, match="needs 3 free blocks"):
        manager.allocate(seq)
    assert seq.block_table == []
    assert manager.num_free_blocks == 2
    assert manager.stats().num_prefix_queries == 0


def test_can_allocate_false_once_blocks_run_out() -> None:
    manager = BlockManager(3, BLOCK_SIZE)
    first = make_seq(0, [1, 2, 3, 4, 5])
    assert manager.can_allocate(first)
    manager.allocate(first)
    assert manager.can_allocate(make_seq(1, [9]))
    assert not manager.can_allocate(make_seq(2, [9, 9, 9, 9, 9]))


def test_allocate_rejects_sequence_with_other_block_size() -> None:
    manager = BlockManager(4, BLOCK_SIZE)
    with pytest.raises(ValueError, match="block_size"):
        manager.allocate(make_seq(0, [1, 2], block_size=8))


def test_free_without_block_table_does_nothing() -> None:
    manager = BlockManager(4, BLOCK_SIZE)
    manager.free(make_seq(0, [1]))
    assert manager.num_free_blocks == 4


# -- prefix caching --------------------------------------------------------------------


def test_shared_prompt_prefix_reuses_full_blocks() -> None:
    manager = BlockManager(16, BLOCK_SIZE)
    prefix = list(range(8))
    first = make_seq(0, [*prefix, 100, 101])
    second = make_seq(1, [*prefix, 200])
    manager.allocate(first)
    manager.allocate(second)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 8
    assert second.block_table[:2] == first.block_table[:2]
    assert second.block_table[2] != first.block_table[2]
    assert [manager.blocks[b].ref_count for b in first.block_table] == [2, 2, 1]
    assert manager.num_used_blocks == 4
    stats = manager.stats()
    assert (stats.num_prefix_queries, stats.num_prefix_hits) == (4, 2)
    assert stats.prefix_hit_rate == 0.5
    manager.free(first)
    assert [manager.blocks[b].ref_count for b in second.block_table] == [1, 1, 1]
    manager.free(second)
    assert manager.num_free_blocks == 16


def test_partial_last_block_is_never_shared() -> None:
    manager = BlockManager(8, BLOCK_SIZE)
    first = make_seq(0, [1, 2, 3, 4, 5, 6])
    second = make_seq(1, [1, 2, 3, 4, 5, 6])
    manager.allocate(first)
    manager.allocate(second)
    assert second.num_cached_tokens == 4
    assert second.block_table[0] == first.block_table[0]
    assert second.block_table[1] != first.block_table[1]


def test_fully_cached_prompt_leaves_last_block_to_compute() -> None:
    manager = BlockManager(8, BLOCK_SIZE)
    first = make_seq(0, list(range(8)))
    second = make_seq(1, list(range(8)))
    manager.allocate(first)
    manager.allocate(second)
    assert second.num_cached_tokens == 4
    assert second.block_table[0] == first.block_table[0]
    assert second.block_table[1] != first.block_table[1]


def test_shared_prefix_differing_in_first_block_gets_no_hit() -> None:
    manager = BlockManager(8, BLOCK_SIZE)
    manager.allocate(make_seq(0, [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    other = make_seq(1, [0, 2, 3, 4, 5, 6, 7, 8, 9])
    manager.allocate(other)
    assert other.num_cached_tokens == 0
    assert manager.stats().num_prefix_hits == 0


def test_hash_collision_with_different_tokens_is_not_a_hit() -> None:
    manager = BlockManager(8, BLOCK_SIZE, hash_fn=lambda prefix_hash, token_ids: 7)
    first = make_seq(0, [1, 2, 3, 4, 0])
    second = make_seq(1, [5, 6, 7, 8, 0])
    manager.allocate(first)
    manager.allocate(second)
    assert second.num_cached_tokens == 0
    assert set(first.block_table).isdisjoint(second.block_table)


def test_same_block_tokens_after_a_different_prefix_is_not_a_hit() -> None:
    """A hash that ignores the prefix must still not splice KV from another context."""
    manager = BlockManager(16, BLOCK_SIZE, hash_fn=lambda prefix_hash, token_ids: hash(token_ids))
    a = make_seq(0, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    c = make_seq(1, [9, 9, 9, 9, 5, 6, 7, 8, 0])
    manager.allocate(a)
    manager.allocate(c)  # now hash((5, 6, 7, 8)) maps to c's second block
    b = make_seq(2, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    manager.allocate(b)
    assert b.block_table[0] == a.block_table[0]
    assert b.block_table[1] not in (a.block_table[1], c.block_table[1])
    assert b.num_cached_tokens == 4


def test_compute_block_hash_chains_the_prefix() -> None:
    first = compute_block_hash(None, (1, 2))
    assert first == compute_block_hash(None, (1, 2))
    assert compute_block_hash(first, (3, 4)) != compute_block_hash(None, (3, 4))
    assert compute_block_hash(0, (3, 4)) != compute_block_hash(None, (3, 4))


def test_freed_sequence_blocks_stay_reusable_as_cached_prefix() -> None:
    manager = BlockManager(8, BLOCK_SIZE)
    first = make_seq(0, list(range(9)))
    manager.allocate(first)
    old_table = list(first.block_table)
    manager.free(first)
    assert manager.num_free_blocks == 8
    second = make_seq(1, [*range(8), 42, 43])
    assert manager.can_allocate(second)
    manager.allocate(second)
    assert second.num_cached_tokens == 8
    assert second.block_table[:2] == old_table[:2]
    assert [manager.blocks[b].ref_count for b in second.block_table] == [1, 1, 1]
    assert manager.num_free_blocks == 5
    assert set(second.block_table).isdisjoint(manager.free_block_ids)


def test_can_allocate_needs_no_free_block_for_hits_on_blocks_in_use() -> None:
    manager = BlockManager(4, BLOCK_SIZE)
    first = make_seq(0, list(range(9)))
    manager.allocate(first)
    assert manager.num_free_blocks == 1
    second = make_seq(1, [*range(8), 5])
    assert second.num_blocks > manager.num_free_blocks
    assert manager.can_allocate(second)
    manager.allocate(second)
    assert second.num_cached_tokens == 8
    assert manager.num_free_blocks == 0
    assert not manager.can_allocate(make_seq(2, [*range(8), 6]))
    assert not manager.can_allocate(make_seq(3, [9]))


def test_reallocating_freed_cached_block_drops_stale_mapping() -> None:
    manager = BlockManager(2, BLOCK_SIZE)
    first = make_seq(0, [1, 2, 3, 4, 0])
    manager.allocate(first)
    cached_id = first.block_table[0]
    cached_hash = manager.blocks[cached_id].hash
    assert cached_hash is not None
    assert manager.cached_block_id(cached_hash) == cached_id
    manager.free(first)
    other = make_seq(1, [9, 9, 9, 9, 9, 9, 9, 9])
    manager.allocate(other)
    assert cached_id in other.block_table
    assert manager.cached_block_id(cached_hash) is None
    manager.free(other)
    again = make_seq(2, [1, 2, 3, 4, 0])
    manager.allocate(again)
    assert again.num_cached_tokens == 0


def test_free_without_keeping_cache_forgets_the_blocks() -> None:
    manager = BlockManager(4, BLOCK_SIZE)
    first = make_seq(0, [1, 2, 3, 4, 0])
    manager.allocate(first)
    manager.free(first, keep_cache=False)
    assert manager.stats().num_cached_blocks == 0
    second = make_seq(1, [1, 2, 3, 4, 0])
    manager.allocate(second)
    assert second.num_cached_tokens == 0


# -- decoding --------------------------------------------------------------------------


def test_append_slot_adds_a_block_only_at_block_boundaries() -> None:
    manager = BlockManager(4, BLOCK_SIZE)
    seq = make_seq(0, [1, 2, 3])
    manager.allocate(seq)
    assert len(seq.block_table) == 1
    seq.append_token(4)  # fills block 0
    manager.append_slot(seq)
    assert len(seq.block_table) == 1
    block0 = manager.blocks[seq.block_table[0]]
    assert block0.hash == compute_block_hash(None, (1, 2, 3, 4))
    assert block0.token_ids == (1, 2, 3, 4)
    assert manager.num_free_blocks == 3
    assert manager.can_append(seq)
    seq.append_token(5)  # starts block 1
    manager.append_slot(seq)
    assert len(seq.block_table) == 2
    assert manager.blocks[seq.block_table[1]].hash is None
    assert manager.num_free_blocks == 2
    for token_id in (6, 7, 8):
        seq.append_token(token_id)
        manager.append_slot(seq)
    assert len(seq.block_table) == 2
    assert manager.blocks[seq.block_table[1]].hash == compute_block_hash(block0.hash, (5, 6, 7, 8))


def test_decoded_blocks_become_a_cached_prefix() -> None:
    manager = BlockManager(8, BLOCK_SIZE)
    seq = make_seq(0, [1, 2, 3])
    manager.allocate(seq)
    for token_id in (4, 5, 6, 7, 8):
        seq.append_token(token_id)
        manager.append_slot(seq)
    follower = make_seq(1, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    manager.allocate(follower)
    assert follower.num_cached_tokens == 8
    assert follower.block_table[:2] == seq.block_table


def test_append_slot_with_block_size_one_hashes_each_new_block() -> None:
    manager = BlockManager(4, 1)
    seq = make_seq(0, [1], block_size=1)
    manager.allocate(seq)
    seq.append_token(2)
    manager.append_slot(seq)
    assert len(seq.block_table) == 2
    assert all(manager.blocks[b].hash is not None for b in seq.block_table)


def test_can_append_false_when_a_new_block_is_needed_and_none_is_free() -> None:
    manager = BlockManager(1, BLOCK_SIZE)
    seq = make_seq(0, [1, 2, 3])
    manager.allocate(seq)
    assert manager.can_append(seq)
    seq.append_token(4)
    manager.append_slot(seq)
    assert not manager.can_append(seq)
    seq.append_token(5)
    with pytest.raises(BlockAllocationError, match="all 1 blocks are in use"):
        manager.append_slot(seq)


def test_append_slot_twice_for_one_token_raises() -> None:
    manager = BlockManager(4, BLOCK_SIZE)
    seq = make_seq(0, [1, 2, 3, 4])
    manager.allocate(seq)
    seq.append_token(5)
    manager.append_slot(seq)
    with pytest.raises(BlockTableError, match="expected"):
        manager.append_slot(seq)


def test_append_slot_without_allocate_raises() -> None:
    manager = BlockManager(4, BLOCK_SIZE)
    seq = make_seq(0, [1, 2])
    seq.append_token(3)
    with pytest.raises(BlockTableError):
        manager.append_slot(seq)


# -- random operations -----------------------------------------------------------------

NUM_BLOCKS = 12
SM_BLOCK_SIZE = 2
# A small vocabulary and a few shared prompt stems make prefix hits common.
STEMS = [[1, 2, 3, 4], [1, 2, 5, 6], [7, 7, 7, 7, 7, 7]]


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.manager = BlockManager(NUM_BLOCKS, SM_BLOCK_SIZE)
        self.live: dict[int, Sequence] = {}
        self.next_seq_id = 0

    @rule(
        stem=st.sampled_from(STEMS),
        tail=st.lists(st.integers(0, 3), max_size=5),
        cut=st.integers(0, 6),
    )
    def add(self, stem: list[int], tail: list[int], cut: int) -> None:
        token_ids = [*stem[:cut], *tail] or [0]
        seq = Sequence(self.next_seq_id, token_ids, SM_BLOCK_SIZE)
        self.next_seq_id += 1
        free_before = self.manager.num_free_blocks
        if not self.manager.can_allocate(seq):
            with pytest.raises(BlockAllocationError):
                self.manager.allocate(seq)
            assert self.manager.num_free_blocks == free_before
            return
        self.manager.allocate(seq)
        assert len(seq.block_table) == seq.num_blocks
        assert seq.num_cached_tokens % SM_BLOCK_SIZE == 0
        assert seq.num_cached_tokens < seq.num_tokens
        for index in range(seq.num_cached_blocks):
            assert self.manager.blocks[seq.block_table[index]].token_ids == tuple(seq.block(index))
        self.live[seq.seq_id] = seq

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), token_id=st.integers(0, 3))
    def append(self, data: st.DataObject, token_id: int) -> None:
        seq = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        if not self.manager.can_append(seq):
            assert self.manager.num_free_blocks == 0
            return
        seq.append_token(token_id)
        self.manager.append_slot(seq)
        assert len(seq.block_table) == seq.num_blocks

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), keep_cache=st.booleans())
    def free(self, data: st.DataObject, keep_cache: bool) -> None:
        seq = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.manager.free(seq, keep_cache=keep_cache)
        assert seq.block_table == []

    @invariant()
    def ref_counts_match_live_block_tables(self) -> None:
        holders = Counter(b for seq in self.live.values() for b in seq.block_table)
        assert ref_counts(self.manager) == dict(holders)

    @invariant()
    def free_and_used_blocks_partition_all_blocks(self) -> None:
        free = self.manager.free_block_ids
        used = self.manager.used_block_ids
        assert len(free) == len(set(free))
        assert set(free).isdisjoint(used)
        assert set(free) | used == set(range(NUM_BLOCKS))
        assert all(self.manager.blocks[b].ref_count == 0 for b in free)
        assert all(self.manager.blocks[b].ref_count > 0 for b in used)

    @invariant()
    def full_blocks_in_live_tables_hold_their_tokens(self) -> None:
        for seq in self.live.values():
            for index in range(seq.num_tokens // SM_BLOCK_SIZE):
                block = self.manager.blocks[seq.block_table[index]]
                assert block.token_ids == tuple(seq.block(index))

    def teardown(self) -> None:
        for seq in self.live.values():
            self.manager.free(seq)
        assert self.manager.num_free_blocks == NUM_BLOCKS
        assert self.manager.num_used_blocks == 0
        assert ref_counts(self.manager) == {}


# Five runs of 1,000 steps each; long runs are the point, so the large-input check is off.
BlockManagerMachine.TestCase.settings = settings(
    max_examples=5,
    stateful_step_count=1_000,
    deadline=None,
    suppress_health_check=[HealthCheck.large_base_example],
)
test_block_manager_random_operations = BlockManagerMachine.TestCase
