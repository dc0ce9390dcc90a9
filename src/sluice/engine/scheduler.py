"""Continuous-batching scheduler with chunked prefill, a bounded waiting queue and abort.

One engine step is three calls, in the manner of nano-vllm::

    batch = scheduler.schedule()
    sampled = model.run(batch)          # {seq_id: token_id} for each item with samples=True
    scheduler.postprocess(batch, sampled, finished_seq_ids)

Every batch must be postprocessed (an empty one too) before the next ``schedule()``.

Each sequence counts ``num_computed_tokens``, the leading tokens whose KV is in the cache.
A scheduled item processes the next ``num_new_tokens`` tokens after them and samples a
token when it reaches the end of ``token_ids``. A decode is the case of one token left; a
prefill (or a recompute after preemption) the case of more. So prompts and decodes mix in
one batch under one token budget, ``max_num_batched_tokens``:

1. Running sequences with one token left decode first (1 token each), so a long prompt never
   delays anyone's next token. A decode whose next token needs a new block and finds none
   preempts the most recently added running sequences (itself last): their blocks are
   freed, their computed count reset, and they go to the FRONT of ``waiting`` to recompute.
2. Running sequences part way through their prefill get the next chunk of what is left.
3. Unless step 1 preempted (blocks are short, so admitting now would only thrash), waiting
   sequences are admitted in FIFO order while ``block_manager.can_allocate`` holds, fewer
   than ``max_num_seqs`` run and budget is left; their prefix-cache hits are not recomputed.

Speculative decoding asks ``schedule`` for lookahead: a decoding sequence may run its new
token and up to ``k`` drafted ones after it (:attr:`ScheduledSequence.num_lookahead_tokens`,
within the token budget). Their slots get blocks at once (``BlockManager.add_lookahead``)
from those no reservation holds; when there are too few it decodes as usual, so
speculation never preempts. ``postprocess`` then takes 1 to ``k + 1`` tokens for it (the
accepted drafts and one more), counts the accepted drafts' K/V as computed, and gives back
the lookahead blocks no accepted token reached (the rejected tokens' slots).

A sampling item reserves the block its new token may need, so ``postprocess`` can always
``append_slot``. If a prefill's last chunk cannot reserve one, it stops one token short and
finishes as a decode next step, where preemption can make room. The engine must stop a
sequence by ``num_blocks * block_size`` tokens (its ``max_model_len``): one that outgrows the
whole cache can only preempt itself, step after step.

Errors::

    RuntimeError
     └── SchedulerError
          ├── QueueFullError     add() while max_waiting sequences wait (gateway: 429/503)
          └── StepOrderError     schedule()/postprocess() called out of turn

Deliberate divergences from nano-vllm:

1. Chunked prefill, mixed with decodes in one batch (nano-vllm runs prefill-only or
   decode-only batches and prefills whole prompts).
2. ``add`` raises :class:`QueueFullError` instead of queueing without bound. Preempted
   sequences still return to the front of ``waiting``, which may so exceed ``max_waiting``
   by at most ``max_num_seqs``.
3. ``abort`` frees a sequence's blocks at once in any state.
4. A prefix-cache hit on a block whose KV another running sequence has not finished
   writing is recomputed (same tokens at the same positions, so the same KV) rather than
   read before it is written.
5. Freed blocks keep their cache entries only if all their KV was written (see ``abort``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from sluice.engine.block_manager import BlockManager
from sluice.engine.sequence import Sequence, SequenceStatus

__all__ = [
    "QueueFullError",
    "ScheduledBatch",
    "ScheduledSequence",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerError",
    "StepOrderError",
]


class SchedulerError(RuntimeError):
    """Base of the scheduler's errors."""


class QueueFullError(SchedulerError):
    """The waiting queue holds ``max_waiting`` sequences; retry later or shed load."""


class StepOrderError(SchedulerError):
    """``schedule`` and ``postprocess`` must alternate, each batch postprocessed once."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduler limits; each must be at least 1 (:class:`ValueError` otherwise).

    ``max_num_seqs`` bounds the running batch, ``max_num_batched_tokens`` the tokens one step
    processes, ``max_waiting`` the waiting queue. Without ``chunked_prefill`` a prompt is
    prefilled in one step, so it may hold at most ``max_num_batched_tokens`` tokens.
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_waiting: int
    block_size: int
    chunked_prefill: bool = True

    def __post_init__(self) -> None:
        limits = {
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_waiting": self.max_waiting,
            "block_size": self.block_size,
        }
        for name, value in limits.items():
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")


@dataclass(frozen=True)
class ScheduledSequence:
    """One sequence's work in a step: tokens ``[num_computed_tokens, +num_new_tokens)``.

    ``samples`` is True when those tokens reach the end of ``seq.token_ids`` (prefill
    complete, or a decode), so the model samples the sequence's next token.
    ``num_lookahead_tokens`` (decodes only) is how many speculative tokens may follow its
    new one: their slots have blocks, and they count against the step's token budget.
    """

    seq: Sequence
    num_computed_tokens: int
    num_new_tokens: int
    samples: bool
    num_lookahead_tokens: int = 0


@dataclass(frozen=True)
class ScheduledBatch:
    """The work of one step, decodes first."""

    items: tuple[ScheduledSequence, ...] = ()

    @property
    def num_batched_tokens(self) -> int:
        """Tokens the step runs, speculative ones included."""
        return sum(item.num_new_tokens + item.num_lookahead_tokens for item in self.items)

    @property
    def sampled_seq_ids(self) -> list[int]:
        return [item.seq.seq_id for item in self.items if item.samples]

    @property
    def is_empty(self) -> bool:
        return not self.items


class Scheduler:
    """Decides which sequences run each step and keeps their KV blocks in step with them."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        if config.block_size != block_manager.block_size:
            raise ValueError(
                f"config has block_size {config.block_size}, "
                f"the block manager {block_manager.block_size}"
            )
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._seqs: dict[int, Sequence] = {}
        self._outstanding: ScheduledBatch | None = None
        self._num_reserved_blocks = 0
        self.num_preemptions = 0  # since the scheduler was made

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def is_finished(self) -> bool:
        """Whether no sequence waits or runs."""
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence.

        Raises :class:`QueueFullError` when ``max_waiting`` sequences wait, and
        :class:`ValueError` for a known ``seq_id``, a sequence already scheduled elsewhere, a
        wrong block size, or one that could never run (its prompt and first token need more
        blocks than the cache has, or, without chunked prefill, more tokens than one step).
        """
        if seq.seq_id in self._seqs:
            raise ValueError(f"sequence {seq.seq_id} was already added")
        if seq.status is not SequenceStatus.WAITING or seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} is {seq.status.value}, not new")
        if seq.block_size != self.config.block_size:
            raise ValueError(
                f"sequence {seq.seq_id} has block_size {seq.block_size}, "
                f"the scheduler {self.config.block_size}"
            )
        num_blocks_needed = seq.num_tokens // seq.block_size + 1
        if num_blocks_needed > self.block_manager.num_blocks:
            raise ValueError(
                f"sequence {seq.seq_id} needs {num_blocks_needed} blocks for its prompt and "
                f"first token, the cache has {self.block_manager.num_blocks}"
            )
        if not self.config.chunked_prefill and seq.num_tokens > self.config.max_num_batched_tokens:
            raise ValueError(
                f"sequence {seq.seq_id} has {seq.num_tokens} tokens, more than "
                f"max_num_batched_tokens={self.config.max_num_batched_tokens} without chunking"
            )
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(
                f"cannot queue sequence {seq.seq_id}: "
                f"{len(self.waiting)} of max_waiting={self.config.max_waiting} are waiting"
            )
        seq.num_computed_tokens = 0
        self.waiting.append(seq)
        self._seqs[seq.seq_id] = seq

    def abort(self, seq_id: int) -> Sequence | None:
        """Drop a waiting or running sequence, free its blocks and mark it FINISHED.

        Returns the sequence, or None if ``seq_id`` is unknown (never added, or done). Its
        blocks stay in the prefix cache only if all their KV was written; a prefill cut short
        drops them. Between ``schedule`` and ``postprocess`` the aborted sequence's item is
        ignored by ``postprocess``.
        """
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return None
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        return seq

    def schedule(self, num_lookahead_tokens: Mapping[int, int] | None = None) -> ScheduledBatch:
        """Choose this step's work; see the module docstring for the order.

        ``num_lookahead_tokens`` maps a decoding sequence's id to the speculative tokens it
        wants after its next one: it gets that many (or fewer) when the budget and the free
        blocks allow, and otherwise decodes as usual (speculation never preempts)."""
        lookahead = num_lookahead_tokens or {}
        if self._outstanding is not None:
            raise StepOrderError("schedule() called before the last batch was postprocessed")
        self._num_reserved_blocks = 0
        budget = self.config.max_num_batched_tokens
        items: list[ScheduledSequence] = []

        num_running_before = len(self.running)
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            if seq.num_tokens - seq.num_computed_tokens != 1:
                index += 1
                continue
            num_lookahead = min(lookahead.get(seq.seq_id, 0), budget - 1)
            if num_lookahead > 0 and self._add_lookahead(seq, num_lookahead):
                items.append(
                    ScheduledSequence(seq, seq.num_computed_tokens, 1, True, num_lookahead)
                )
                budget -= 1 + num_lookahead
                index += 1
                continue
            if not (self._reserve_block(seq) or self._preempt_for(seq)):
                break  # seq preempted itself: it was the last running sequence left
            items.append(ScheduledSequence(seq, seq.num_computed_tokens, 1, samples=True))
            budget -= 1
            index += 1

        for seq in self.running:
            if budget == 0:
                break
            if seq.num_tokens - seq.num_computed_tokens > 1:
                budget -= self._schedule_prefill(seq, budget, items)

        preempted = len(self.running) < num_running_before
        unwritten: set[int] | None = None
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            seq = self.waiting[0]
            if not self.config.chunked_prefill and seq.num_tokens > budget:
                break
            if not self._can_admit(seq):
                break
            if unwritten is None:
                unwritten = self._unwritten_block_ids()
            self.waiting.popleft()
            self._admit(seq, unwritten)
            budget -= self._schedule_prefill(seq, budget, items)

        batch = ScheduledBatch(tuple(items))
        self._outstanding = batch
        return batch

    def postprocess(
        self,
        batch: ScheduledBatch,
        sampled_token_ids: Mapping[int, int | tuple[int, ...]],
        finished_seq_ids: Collection[int] = (),
    ) -> None:
        """Record that the model ran ``batch``.

        ``sampled_token_ids`` maps the id of each sampling item's sequence to its new token,
        or to its new tokens (1 to ``1 + num_lookahead_tokens``: the accepted speculative
        ones and one more), aborted sequences may be left out; ``finished_seq_ids`` names those that end with
        it (EOS, token limit). Each item's tokens count as computed; each new token is
        appended with its KV slot, except a finishing sequence's, whose KV is never needed:
        that sequence is freed, marked FINISHED and leaves ``running``. Raises
        :class:`StepOrderError` for any batch but the last scheduled, and
        :class:`ValueError` (changing nothing) for ids that do not match its sampling items.
        """
        if batch is not self._outstanding:
            raise StepOrderError("postprocess() needs the batch the last schedule() returned")
        sampling = set(batch.sampled_seq_ids)
        live = {seq_id for seq_id in sampling if seq_id in self._seqs}
        if not sampled_token_ids.keys() <= sampling or not live <= sampled_token_ids.keys():
            raise ValueError(
                f"sampled tokens for {sorted(sampled_token_ids)}, batch samples {sorted(live)}"
            )
        if not set(finished_seq_ids) <= sampling:
            raise ValueError(
                f"finished {sorted(finished_seq_ids)} are not all sampled in this batch"
            )
        new_tokens: dict[int, tuple[int, ...]] = {}
        for item in batch.items:
            token_ids = sampled_token_ids.get(item.seq.seq_id)
            if token_ids is None:
                continue
            tokens = (token_ids,) if isinstance(token_ids, int) else tuple(token_ids)
            if not 1 <= len(tokens) <= 1 + item.num_lookahead_tokens:
                raise ValueError(
                    f"sequence {item.seq.seq_id} sampled {len(tokens)} tokens, "
                    f"its item allows 1 to {1 + item.num_lookahead_tokens}"
                )
            new_tokens[item.seq.seq_id] = tokens
        self._outstanding = None
        for item in batch.items:
            seq = item.seq
            if seq.status is SequenceStatus.FINISHED:
                continue  # aborted while the model ran
            if not item.samples:
                seq.num_computed_tokens += item.num_new_tokens
                continue
            tokens = new_tokens[seq.seq_id]
            # The accepted speculative tokens' K/V was written by the verify; the last new
            # token's is not.
            seq.num_computed_tokens += item.num_new_tokens + len(tokens) - 1
            finishes = seq.seq_id in finished_seq_ids
            for number, token_id in enumerate(tokens, 1):
                seq.append_token(token_id)
                if not (finishes and number == len(tokens)):
                    self.block_manager.append_slot(seq)  # reserved, or a lookahead block
            if finishes:
                self.block_manager.free(seq)  # every slotted token's KV is written
                seq.num_computed_tokens = 0
                seq.status = SequenceStatus.FINISHED
                self.running.remove(seq)
                del self._seqs[seq.seq_id]
            elif seq.num_lookahead_blocks:
                self.block_manager.free_lookahead(seq)  # the rejected tokens' slots

    # -- internals ----------------------------------------------------------------------

    def _schedule_prefill(self, seq: Sequence, budget: int, items: list[ScheduledSequence]) -> int:
        """Schedule the next chunk of ``seq`` within ``budget``; return its token count."""
        num_left = seq.num_tokens - seq.num_computed_tokens
        num_new = min(num_left, budget)
        if num_new < num_left and not self.config.chunked_prefill:
            return 0
        samples = num_new == num_left
        if samples and not self._reserve_block(seq):
            num_new -= 1  # stop one short; the last token goes as a decode next step
            samples = False
        if num_new == 0:
            return 0
        items.append(ScheduledSequence(seq, seq.num_computed_tokens, num_new, samples))
        return num_new

    def _add_lookahead(self, seq: Sequence, num_lookahead: int) -> bool:
        """Give ``seq`` blocks for its next token and ``num_lookahead`` after it, from the
        blocks no reservation holds; False (nothing taken) if too few are free."""
        num_needed = self.block_manager.num_lookahead_blocks_needed(seq, num_lookahead + 1)
        if self.block_manager.num_free_blocks - self._num_reserved_blocks < num_needed:
            return False
        self.block_manager.add_lookahead(seq, num_lookahead + 1)
        return True

    def _reserve_block(self, seq: Sequence) -> bool:
        """Reserve the block ``seq``'s next token needs, if any; False if none is free."""
        if seq.num_tokens % seq.block_size != 0:
            return True
        if self.block_manager.num_free_blocks - self._num_reserved_blocks < 1:
            return False
        self._num_reserved_blocks += 1
        return True

    def _preempt_for(self, seq: Sequence) -> bool:
        """Preempt from the back of ``running`` until ``seq`` can reserve; False if it went."""
        while True:
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
            if self._reserve_block(seq):
                return True

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks, keeping them cached only if all their KV was written."""
        num_full_blocks = seq.num_tokens // seq.block_size
        kv_written = seq.num_computed_tokens >= num_full_blocks * seq.block_size
        self.block_manager.free(seq, keep_cache=kv_written)
        seq.num_computed_tokens = 0

    def _can_admit(self, seq: Sequence) -> bool:
        """``can_allocate``, leaving the reserved blocks free (conservatively, if any)."""
        if not self.block_manager.can_allocate(seq):
            return False
        reserved = self._num_reserved_blocks
        return reserved == 0 or seq.num_blocks + reserved <= self.block_manager.num_free_blocks

    def _unwritten_block_ids(self) -> set[int]:
        """Blocks of running sequences whose KV is not all written yet."""
        unwritten: set[int] = set()
        for seq in self.running:
            unwritten.update(seq.block_table[seq.num_computed_tokens // seq.block_size :])
        return unwritten

    def _admit(self, seq: Sequence, unwritten: set[int]) -> None:
        """Allocate ``seq``'s blocks and start it after its usable prefix-cache hits."""
        self.block_manager.allocate(seq)
        num_computed = seq.num_cached_tokens
        for index in range(seq.num_cached_blocks):
            if seq.block_table[index] in unwritten:
                num_computed = index * seq.block_size
                break
        seq.num_computed_tokens = num_computed
        unwritten.update(seq.block_table[num_computed // seq.block_size :])
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
