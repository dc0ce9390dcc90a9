"""Scheduler behaviour: continuous batching, chunked prefill, prefix hits, bounds, abort, preemption.

A fake model samples token 7 for every sampling item. A Hypothesis state machine drives random
add / abort / step / finish operations and checks that no batch breaks a limit and that no
KV block leaks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from sluice.engine import (
    BlockManager,
    QueueFullError,
    ScheduledBatch,
    Scheduler,
    SchedulerConfig,
    Sequence,
    SequenceStatus,
    StepOrderError,
)

BLOCK_SIZE = 4
TOKEN = 7


def make_scheduler(
    *,
    num_blocks: int = 64,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_waiting: int = 16,
    chunked_prefill: bool = True,
    block_size: int = BLOCK_SIZE,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_waiting=max_waiting,
        block_size=block_size,
        chunked_prefill=chunked_prefill,
    )
    return Scheduler(config, BlockManager(num_blocks, block_size))


def make_seq(
    seq_id: int, num_tokens: int, *, first: int = 100, block_size: int = BLOCK_SIZE
) -> Sequence:
    return Sequence(seq_id, range(first, first + num_tokens), block_size)


def step(scheduler: Scheduler, finished: Collection[int] = ()) -> ScheduledBatch:
    """One engine step with a model that always samples ``TOKEN``."""
    batch = scheduler.schedule()
    sampled = dict.fromkeys(batch.sampled_seq_ids, TOKEN)
    scheduler.postprocess(batch, sampled, finished)
    return batch


def work(batch: ScheduledBatch) -> list[tuple[int, int, bool]]:
    return [(item.seq.seq_id, item.num_new_tokens, item.samples) for item in batch.items]


def assert_no_blocks_held(scheduler: Scheduler) -> None:
    manager = scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    assert all(block.ref_count == 0 for block in manager.blocks)


# -- configuration and queue bounds -------------------------------------------------------


@pytest.mark.parametrize(
    "field", ["max_num_seqs", "max_num_batched_tokens", "max_waiting", "block_size"]
)
def test_config_rejects_limits_below_one(field: str) -> None:
    values: dict[str, Any] = {
        "max_num_seqs": 1,
        "max_num_batched_tokens": 1,
        "max_waiting": 1,
        "block_size": 1,
    }
    values[field] = 0
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**values)


def test_scheduler_rejects_block_size_mismatch() -> None:
    config = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8, max_waiting=1, block_size=8)
    with pytest.raises(ValueError, match="block_size"):
        Scheduler(config, BlockManager(4, BLOCK_SIZE))


def test_add_raises_queue_full_when_max_waiting_wait() -> None:
    scheduler = make_scheduler(max_waiting=2)
    scheduler.add(make_seq(0, 4))
    scheduler.add(make_seq(1, 4))
    with pytest.raises(QueueFullError, match="max_waiting=2"):
        scheduler.add(make_seq(2, 4))
    assert [seq.seq_id for seq in scheduler.waiting] == [0, 1]
    step(scheduler)  # both admitted: the queue has room again
    scheduler.add(make_seq(2, 4))
    assert scheduler.num_waiting == 1


def test_add_rejects_duplicate_ids_and_sequences_that_can_never_fit() -> None:
    scheduler = make_scheduler(num_blocks=2)
    scheduler.add(make_seq(0, 4))
    with pytest.raises(ValueError, match="already added"):
        scheduler.add(make_seq(0, 4))
    with pytest.raises(ValueError, match="needs 3 blocks"):
        scheduler.add(make_seq(1, 8))
    unchunked = make_scheduler(max_num_batched_tokens=8, chunked_prefill=False)
    with pytest.raises(ValueError, match="without chunking"):
        unchunked.add(make_seq(0, 9))


def test_schedule_and_postprocess_must_alternate() -> None:
    scheduler = make_scheduler()
    scheduler.add(make_seq(0, 4))
    batch = scheduler.schedule()
    with pytest.raises(StepOrderError):
        scheduler.schedule()
    scheduler.postprocess(batch, {0: TOKEN})
    with pytest.raises(StepOrderError):
        scheduler.postprocess(batch, {0: TOKEN})


def test_postprocess_rejects_tokens_that_do_not_match_the_batch() -> None:
    scheduler = make_scheduler()
    scheduler.add(make_seq(0, 4))
    batch = scheduler.schedule()
    with pytest.raises(ValueError, match="sampled tokens"):
        scheduler.postprocess(batch, {})
    with pytest.raises(ValueError, match="sampled tokens"):
        scheduler.postprocess(batch, {0: TOKEN, 1: TOKEN})
    with pytest.raises(ValueError, match="finished"):
        scheduler.postprocess(batch, {0: TOKEN}, finished_seq_ids={1})
    scheduler.postprocess(batch, {0: TOKEN})
    assert scheduler.running[0].token_ids[-1] == TOKEN


# -- continuous batching and chunked prefill -----------------------------------------------


def test_finished_sequences_leave_and_waiting_ones_join_every_step() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    for seq_id in range(3):
        scheduler.add(make_seq(seq_id, 3))

    assert work(step(scheduler)) == [(0, 3, True), (1, 3, True)]
    assert [seq.seq_id for seq in scheduler.waiting] == [2]

    assert work(step(scheduler, finished={0})) == [(0, 1, True), (1, 1, True)]
    assert [seq.seq_id for seq in scheduler.running] == [1]

    assert work(step(scheduler)) == [(1, 1, True), (2, 3, True)]
    assert scheduler.num_waiting == 0
    seq_1 = scheduler.running[0]
    assert seq_1.token_ids[3:] == [TOKEN, TOKEN, TOKEN]

    step(scheduler, finished={1, 2})
    assert scheduler.is_finished()
    assert_no_blocks_held(scheduler)


def test_long_prompt_is_prefilled_in_chunks_while_running_sequence_decodes_every_step() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=32)
    decoder = make_seq(0, 4)
    scheduler.add(decoder)
    step(scheduler)
    long_prompt = make_seq(1, 100, first=1000)
    scheduler.add(long_prompt)

    batches = [step(scheduler) for _ in range(4)]

    assert [work(batch) for batch in batches] == [
        [(0, 1, True), (1, 31, False)],
        [(0, 1, True), (1, 31, False)],
        [(0, 1, True), (1, 31, False)],
        [(0, 1, True), (1, 7, True)],
    ]
    assert [batch.items[1].num_computed_tokens for batch in batches] == [0, 31, 62, 93]
    assert all(batch.num_batched_tokens <= 32 for batch in batches)
    assert decoder.num_completion_tokens == 5
    assert long_prompt.num_completion_tokens == 1
    assert long_prompt.num_computed_tokens == 100
    assert work(step(scheduler)) == [(0, 1, True), (1, 1, True)]


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room_for_all_of_it() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=10, chunked_prefill=False)
    scheduler.add(make_seq(0, 8))
    scheduler.add(make_seq(1, 8, first=500))
    assert work(step(scheduler)) == [(0, 8, True)]
    assert work(step(scheduler)) == [(0, 1, True), (1, 8, True)]


# -- prefix cache --------------------------------------------------------------------------


def test_prefix_cache_hit_skips_cached_tokens() -> None:
    scheduler = make_scheduler()
    scheduler.add(make_seq(0, 12))
    step(scheduler, finished={0})
    sharer = Sequence(1, [*range(100, 112), 1, 2, 3, 4], BLOCK_SIZE)
    scheduler.add(sharer)

    batch = step(scheduler)

    assert sharer.num_cached_tokens == 12
    assert [(item.num_computed_tokens, item.num_new_tokens) for item in batch.items] == [(12, 4)]
    assert sharer.num_computed_tokens == 16


def test_prefix_hit_on_blocks_still_being_prefilled_is_recomputed() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add(make_seq(0, 12))
    step(scheduler)  # sequence 0 has written blocks 0 and 1, not block 2
    sharer = make_seq(1, 13)
    scheduler.add(sharer)

    batch = step(scheduler)

    assert sharer.num_cached_tokens == 12  # the block manager reports all three blocks...
    assert work(batch) == [(0, 4, True), (1, 4, False)]
    assert batch.items[1].num_computed_tokens == 8  # ...but block 2 is not read unwritten


# -- abort ---------------------------------------------------------------------------------


def test_abort_waiting_sequence_frees_everything() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add(make_seq(0, 4))
    scheduler.add(make_seq(1, 4))
    step(scheduler)
    aborted = scheduler.abort(1)
    assert aborted is not None
    assert aborted.status is SequenceStatus.FINISHED
    assert scheduler.num_waiting == 0
    assert scheduler.abort(0) is not None
    assert scheduler.is_finished()
    assert_no_blocks_held(scheduler)


def test_abort_mid_prefill_frees_every_block_and_drops_unwritten_cache() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add(make_seq(0, 40))
    step(scheduler)
    seq = scheduler.running[0]
    assert 0 < seq.num_computed_tokens < seq.num_tokens

    assert scheduler.abort(0) is seq

    assert seq.status is SequenceStatus.FINISHED
    assert scheduler.is_finished()
    assert_no_blocks_held(scheduler)
    again = make_seq(1, 40)
    scheduler.add(again)
    step(scheduler)
    assert again.num_cached_tokens == 0


def test_abort_decoding_sequence_frees_every_block() -> None:
    scheduler = make_scheduler()
    scheduler.add(make_seq(0, 6))
    for _ in range(5):
        step(scheduler)
    assert scheduler.abort(0) is not None
    assert scheduler.abort(0) is None
    assert scheduler.is_finished()
    assert_no_blocks_held(scheduler)


def test_abort_while_model_runs_is_ignored_by_postprocess() -> None:
    scheduler = make_scheduler()
    scheduler.add(make_seq(0, 6))
    scheduler.add(make_seq(1, 6, first=500))
    batch = scheduler.schedule()
    aborted = scheduler.abort(0)
    scheduler.postprocess(batch, {1: TOKEN})
    assert aborted is not None
    assert aborted.num_completion_tokens == 0
    assert [seq.seq_id for seq in scheduler.running] == [1]
    scheduler.abort(1)
    assert_no_blocks_held(scheduler)


def test_abort_unknown_sequence_returns_none() -> None:
    assert make_scheduler().abort(42) is None


# -- preemption ----------------------------------------------------------------------------


def test_preempted_sequence_recomputes_and_completes_with_all_its_tokens() -> None:
    max_completion = 6
    scheduler = make_scheduler(num_blocks=5, block_size=2, max_num_batched_tokens=16)
    seqs = [make_seq(seq_id, 2, first=10 * seq_id, block_size=2) for seq_id in range(2)]
    for seq in seqs:
        scheduler.add(seq)
    preempted: set[int] = set()

    for _ in range(50):
        if scheduler.is_finished():
            break
        batch = scheduler.schedule()
        preempted.update(seq.seq_id for seq in scheduler.waiting if seq.num_completion_tokens)
        assert sum(seq.num_blocks for seq in scheduler.running) <= 5
        finished = {
            seq_id
            for seq_id in batch.sampled_seq_ids
            if seqs[seq_id].num_completion_tokens == max_completion - 1
        }
        scheduler.postprocess(batch, dict.fromkeys(batch.sampled_seq_ids, TOKEN), finished)

    assert preempted == {1}
    assert scheduler.is_finished()
    assert [seq.token_ids[2:] for seq in seqs] == [[TOKEN] * max_completion] * 2
    assert all(seq.status is SequenceStatus.FINISHED for seq in seqs)
    assert_no_blocks_held(scheduler)


def test_lone_sequence_without_a_free_block_preempts_itself() -> None:
    scheduler = make_scheduler(num_blocks=3, block_size=1)
    lone = make_seq(0, 1, block_size=1)
    scheduler.add(lone)
    step(scheduler)
    step(scheduler)  # 3 tokens in 3 blocks: the next token needs a fourth

    batch = scheduler.schedule()

    assert batch.is_empty
    assert list(scheduler.waiting) == [lone]
    assert lone.status is SequenceStatus.WAITING
    assert lone.num_computed_tokens == 0
    assert lone.block_table == []
    assert_no_blocks_held(scheduler)
    scheduler.postprocess(batch, {})
    # Next step it recomputes all but its last token, which has no block to go to.
    assert work(step(scheduler)) == [(0, 2, False)]


# -- random operations ---------------------------------------------------------------------


class SchedulerMachine(RuleBasedStateMachine):
    """Random add / abort / step / finish operations against a small KV cache."""

    def __init__(self) -> None:
        super().__init__()
        self.scheduler: Scheduler | None = None
        self.next_seq_id = 0

    @property
    def sched(self) -> Scheduler:
        assert self.scheduler is not None
        return self.scheduler

    @initialize(
        num_blocks=st.integers(4, 16),
        block_size=st.integers(1, 4),
        max_num_seqs=st.integers(1, 4),
        max_num_batched_tokens=st.integers(1, 24),
        chunked_prefill=st.booleans(),
    )
    def configure(
        self,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        chunked_prefill: bool,
    ) -> None:
        self.scheduler = make_scheduler(
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_waiting=4,
            chunked_prefill=chunked_prefill,
        )

    @rule(prefix=st.sampled_from([(), (1, 2, 3, 4), (1, 2, 3, 4, 5, 6, 7, 8)]), data=st.data())
    def add(self, prefix: tuple[int, ...], data: st.DataObject) -> None:
        config = self.sched.config
        max_tokens = (self.sched.block_manager.num_blocks - 1) * config.block_size
        if not config.chunked_prefill:
            max_tokens = min(max_tokens, config.max_num_batched_tokens)
        suffix = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=12))
        token_ids = [*prefix, *suffix][:max_tokens]
        seq = Sequence(self.next_seq_id, token_ids, config.block_size)
        self.next_seq_id += 1
        try:
            self.sched.add(seq)
        except QueueFullError:
            # Preempted sequences may push the queue past its bound; add() never does.
            assert self.sched.num_waiting >= config.max_waiting

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        known = [seq.seq_id for seq in [*self.sched.waiting, *self.sched.running]]
        seq_id = data.draw(st.sampled_from([*known, -1]))
        aborted = self.sched.abort(seq_id)
        assert (aborted is None) == (seq_id == -1)

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        config = self.sched.config
        batch = self.sched.schedule()
        assert batch.num_batched_tokens <= config.max_num_batched_tokens
        assert len(batch.items) <= config.max_num_seqs
        assert len({item.seq.seq_id for item in batch.items}) == len(batch.items)
        assert all(item.num_new_tokens >= 1 for item in batch.items)
        sampled = batch.sampled_seq_ids
        finished = data.draw(st.sets(st.sampled_from(sampled))) if sampled else set()
        self.sched.postprocess(batch, dict.fromkeys(sampled, TOKEN), finished)

    @invariant()
    def blocks_match_running_sequences(self) -> None:
        manager = self.sched.block_manager
        held = Counter(block_id for seq in self.sched.running for block_id in seq.block_table)
        assert {b.block_id: b.ref_count for b in manager.blocks if b.ref_count} == dict(held)
        assert manager.num_free_blocks + manager.num_used_blocks == manager.num_blocks
        assert len(self.sched.running) <= self.sched.config.max_num_seqs
        for seq in self.sched.running:
            assert len(seq.block_table) == seq.num_blocks
            assert 0 <= seq.num_computed_tokens < seq.num_tokens
        assert all(not seq.block_table for seq in self.sched.waiting)

    def teardown(self) -> None:
        if self.scheduler is None:
            return
        for seq in [*self.sched.waiting, *self.sched.running]:
            self.sched.abort(seq.seq_id)
        assert self.sched.is_finished()
        assert_no_blocks_held(self.sched)


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(
    max_examples=60,
    stateful_step_count=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
