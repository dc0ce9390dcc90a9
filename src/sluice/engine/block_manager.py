"""Paged KV-cache block manager with chained-hash prefix caching, in the manner of nano-vllm.

The KV cache is ``num_blocks`` physical blocks of ``block_size`` token slots. A sequence's
``block_table`` maps its logical blocks to physical ones. Blocks are reference counted so
that sequences sharing a prompt prefix share its blocks.

Prefix caching. Only FULL blocks are cached. The hash of full block ``i`` commits to the
whole prefix: ``hash_i = compute_block_hash(hash_{i-1}, tokens_i)`` (``None`` for block 0).
``compute_block_hash`` is BLAKE2b (8-byte digest) over the previous hash and the token ids,
so hashes are stable across processes, unlike Python's salted ``hash``. A hit is verified
exactly, so a hash collision can never hand out wrong KV: the candidate block must hold the
same token ids AND have been filled after the very block (id and generation) that the
previous hit resolved to. By induction the whole prefix matches.

Freed blocks keep their hash and token ids and go to the back of the free list, so a later
request with the same prefix can still reuse them; new blocks are taken from the front
(least recently freed first). Re-allocating a block for other content bumps its generation
and drops its stale hash mapping.

Errors::

    RuntimeError
     └── BlockManagerError
          ├── BlockAllocationError   not enough free blocks (check can_allocate/can_append)
          └── BlockTableError        the sequence's block table is in the wrong state

Deliberate divergences from nano-vllm:

1. Hits are verified by token ids and parent block, not by token ids alone.
2. At least one prompt token is always left to compute: a prompt made entirely of cached
   full blocks reuses all but its last block, so prefill has a token to produce logits from.
3. ``can_allocate`` counts hits on blocks already in use, which need no free block.
4. The free list is an ``OrderedDict`` so that a cached free block is taken off it in O(1).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from sluice.engine.sequence import Sequence

__all__ = [
    "Block",
    "BlockAllocationError",
    "BlockHashFn",
    "BlockManager",
    "BlockManagerError",
    "BlockManagerStats",
    "BlockTableError",
    "compute_block_hash",
]

BlockHashFn = Callable[[int | None, tuple[int, ...]], int]
"""``(prefix_hash, token_ids) -> hash`` of a full block; ``prefix_hash`` is None for block 0."""


class BlockManagerError(RuntimeError):
    """Base of the block manager's errors."""


class BlockAllocationError(BlockManagerError):
    """Not enough free blocks; callers check ``can_allocate``/``can_append`` first."""


class BlockTableError(BlockManagerError):
    """A sequence's block table does not fit the operation (e.g. allocated twice)."""


def compute_block_hash(prefix_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Stable 64-bit hash of a full block chained to the hash of the blocks before it.

    Token ids are packed as signed 64-bit integers; ``prefix_hash`` (when present) as an
    unsigned one, so ``None`` and every int hash differently.
    """
    hasher = hashlib.blake2b(digest_size=8)
    if prefix_hash is not None:
        hasher.update(b"\x01" + prefix_hash.to_bytes(8, "little"))
    else:
        hasher.update(b"\x00")
    hasher.update(array("q", token_ids).tobytes())
    return int.from_bytes(hasher.digest(), "little")


@dataclass(eq=False)
class Block:
    """One physical KV-cache block.

    ``hash`` and ``token_ids`` are set once the block is full (and kept after it is freed);
    ``parent`` is the ``(block_id, generation)`` of the block before it in the table that
    filled it, None for a first block. ``generation`` counts re-allocations to new content.
    """

    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()
    parent: tuple[int, int] | None = None
    generation: int = 0


@dataclass(frozen=True)
class BlockManagerStats:
    """A snapshot of the block manager's counters.

    ``num_prefix_queries`` counts full prompt blocks eligible for reuse at allocation;
    ``num_prefix_hits`` counts those reused.
    """

    num_blocks: int
    block_size: int
    num_free_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    num_prefix_queries: int
    num_prefix_hits: int

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_prefix_hits / self.num_prefix_queries if self.num_prefix_queries else 0.0


class BlockManager:
    """Allocates KV-cache blocks to sequences and shares cached prompt prefixes.

    Typical use: ``if bm.can_allocate(seq): bm.allocate(seq)`` before prefill; for each
    decoded token ``if bm.can_append(seq): seq.append_token(t); bm.append_slot(seq)``;
    ``bm.free(seq)`` when the sequence finishes or is preempted.
    """

    def __init__(
        self, num_blocks: int, block_size: int, *, hash_fn: BlockHashFn = compute_block_hash
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._hash_fn = hash_fn
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        self._hash_to_block_id: dict[int, int] = {}
        self._free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._used_block_ids: set[int] = set()
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return len(self._used_block_ids)

    @property
    def free_block_ids(self) -> list[int]:
        """Free block ids, next to be handed out first."""
        return list(self._free_block_ids)

    @property
    def used_block_ids(self) -> frozenset[int]:
        return frozenset(self._used_block_ids)

    def cached_block_id(self, block_hash: int) -> int | None:
        """The block registered under ``block_hash``, if any."""
        return self._hash_to_block_id.get(block_hash)

    def stats(self) -> BlockManagerStats:
        return BlockManagerStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            num_free_blocks=self.num_free_blocks,
            num_used_blocks=self.num_used_blocks,
            num_cached_blocks=len(self._hash_to_block_id),
            num_prefix_queries=self.num_prefix_queries,
            num_prefix_hits=self.num_prefix_hits,
        )

    # -- allocation ---------------------------------------------------------------------

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether ``allocate(seq)`` would find enough free blocks now."""
        self._check_block_size(seq)
        hits = self._match_cached_prefix(seq)
        num_shared = sum(1 for block_id in hits if self.blocks[block_id].ref_count > 0)
        return seq.num_blocks - num_shared <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Give ``seq`` a block table for its tokens, reusing cached prefix blocks.

        Sets ``seq.num_cached_tokens`` to the tokens covered by prefix-cache hits. Full
        blocks that miss are registered at once: their KV is written by the prefill that
        follows. Raises :class:`BlockTableError` if ``seq`` already has a block table and
        :class:`BlockAllocationError` (changing nothing) if too few blocks are free.
        """
        self._check_block_size(seq)
        if seq.block_table:
            raise BlockTableError(f"sequence {seq.seq_id} already has a block table")
        hits = self._match_cached_prefix(seq)
        num_shared = sum(1 for block_id in hits if self.blocks[block_id].ref_count > 0)
        num_needed = seq.num_blocks - num_shared
        if num_needed > self.num_free_blocks:
            raise BlockAllocationError(
                f"sequence {seq.seq_id} needs {num_needed} free blocks, "
                f"{self.num_free_blocks} of {self.num_blocks} are free"
            )
        self.num_prefix_queries += (seq.num_tokens - 1) // self.block_size
        self.num_prefix_hits += len(hits)
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free_block_ids[block_id]
                self._used_block_ids.add(block_id)
            block.ref_count += 1
            seq.block_table.append(block_id)
        for index in range(len(hits), seq.num_blocks):
            block = self._take_free_block()
            seq.block_table.append(block.block_id)
            if (index + 1) * self.block_size <= seq.num_tokens:
                self._register_full_block(seq, index)
        seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_allocations += 1

    def free(self, seq: Sequence, *, keep_cache: bool = True) -> None:
        """Release ``seq``'s blocks (last block first), clear its table and cached count.

        Blocks whose ref count drops to 0 go to the back of the free list, still cached
        unless ``keep_cache`` is False: pass False when the prefill that was to write the
        blocks' KV never ran (e.g. the request was cancelled in between).
        Freeing a sequence without a block table does nothing.
        """
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            if block.ref_count < 1:
                raise BlockTableError(
                    f"sequence {seq.seq_id} holds block {block_id}, which is not in use"
                )
            block.ref_count -= 1
            if block.ref_count == 0:
                if not keep_cache:
                    self._forget(block)
                self._used_block_ids.discard(block_id)
                self._free_block_ids[block_id] = None
        seq.block_table.clear()
        seq.num_cached_tokens = 0
        seq.num_lookahead_blocks = 0

    # -- decoding -----------------------------------------------------------------------

    def can_append(self, seq: Sequence) -> bool:
        """Whether ``seq`` can grow by one token: room in its last block, or a free block."""
        return seq.num_tokens % self.block_size != 0 or self.num_free_blocks > 0

    def append_slot(self, seq: Sequence) -> None:
        """Make room for the token just appended with ``seq.append_token``.

        Call exactly once per appended token. If that token starts a new logical block, a
        free block is appended to the block table (:class:`BlockAllocationError` if none is
        free). If it fills the last block, that block's hash is computed and registered.
        Raises :class:`BlockTableError` if the table does not match ``num_tokens - 1``
        tokens (no ``allocate``, or ``append_slot`` called twice for one token).
        """
        self._check_block_size(seq)
        starts_block = (seq.num_tokens - 1) % self.block_size == 0
        expected = seq.num_blocks - 1 if starts_block else seq.num_blocks
        num_owned = len(seq.block_table) - seq.num_lookahead_blocks
        if not seq.block_table or num_owned != expected:
            raise BlockTableError(
                f"sequence {seq.seq_id} has {num_owned} blocks, expected "
                f"{expected} before append_slot for {seq.num_tokens} tokens"
            )
        if starts_block:
            if seq.num_lookahead_blocks:
                seq.num_lookahead_blocks -= 1  # its K/V may already be written: keep it
            else:
                block = self._take_free_block()
                seq.block_table.append(block.block_id)
        if seq.num_tokens % self.block_size == 0:
            self._register_full_block(seq, seq.num_blocks - 1)

    # -- speculation --------------------------------------------------------------------

    def num_lookahead_blocks_needed(self, seq: Sequence, num_slots: int) -> int:
        """Free blocks ``add_lookahead(seq, num_slots)`` would take."""
        num_covered = len(seq.block_table) * self.block_size
        return max(0, -(-(seq.num_tokens + num_slots - num_covered) // self.block_size))

    def add_lookahead(self, seq: Sequence, num_slots: int) -> None:
        """Give ``seq`` blocks for ``num_slots`` token slots past its tokens (speculative
        tokens' K/V), so that ``append_slot`` uses them as its tokens are accepted.
        Raises :class:`BlockAllocationError` (changing nothing) if too few are free."""
        self._check_block_size(seq)
        if not seq.block_table:
            raise BlockTableError(f"sequence {seq.seq_id} has no block table")
        num_needed = self.num_lookahead_blocks_needed(seq, num_slots)
        if num_needed > self.num_free_blocks:
            raise BlockAllocationError(
                f"sequence {seq.seq_id} needs {num_needed} lookahead blocks, "
                f"{self.num_free_blocks} are free"
            )
        for _ in range(num_needed):
            seq.block_table.append(self._take_free_block().block_id)
        seq.num_lookahead_blocks += num_needed

    def free_lookahead(self, seq: Sequence) -> None:
        """Return the lookahead blocks no accepted token came to use (their K/V is that of
        rejected drafts: never cached)."""
        for _ in range(seq.num_lookahead_blocks):
            block = self.blocks[seq.block_table.pop()]
            block.ref_count = 0
            self._forget(block)
            self._used_block_ids.discard(block.block_id)
            self._free_block_ids[block.block_id] = None
        seq.num_lookahead_blocks = 0

    # -- internals ----------------------------------------------------------------------

    def _check_block_size(self, seq: Sequence) -> None:
        if seq.block_size != self.block_size:
            raise ValueError(
                f"sequence {seq.seq_id} has block_size {seq.block_size}, "
                f"the block manager {self.block_size}"
            )

    def _match_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest verified cached prefix, leaving one token to compute."""
        hits: list[int] = []
        prefix_hash: int | None = None
        parent: tuple[int, int] | None = None
        for index in range((seq.num_tokens - 1) // self.block_size):
            token_ids = tuple(seq.block(index))
            block_hash = self._hash_fn(prefix_hash, token_ids)
            block_id = self._hash_to_block_id.get(block_hash)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != token_ids or block.parent != parent:
                break
            hits.append(block_id)
            prefix_hash = block_hash
            parent = (block_id, block.generation)
        return hits

    def _take_free_block(self) -> Block:
        """Take the least recently freed block for new content, dropping its old cache entry."""
        if not self._free_block_ids:
            raise BlockAllocationError(f"all {self.num_blocks} blocks are in use")
        block_id, _ = self._free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        self._forget(block)
        block.generation += 1
        block.ref_count = 1
        self._used_block_ids.add(block_id)
        return block

    def _forget(self, block: Block) -> None:
        if block.hash is not None and self._hash_to_block_id.get(block.hash) == block.block_id:
            del self._hash_to_block_id[block.hash]
        block.hash = None
        block.token_ids = ()
        block.parent = None

    def _register_full_block(self, seq: Sequence, index: int) -> None:
        """Hash the full logical block ``index`` of ``seq`` and map the hash to its block."""
        block = self.blocks[seq.block_table[index]]
        prefix_hash: int | None = None
        parent: tuple[int, int] | None = None
        if index > 0:
            previous = self.blocks[seq.block_table[index - 1]]
            if previous.hash is None:
                raise BlockTableError(
                    f"block {previous.block_id} of sequence {seq.seq_id} is full but unhashed"
                )
            prefix_hash = previous.hash
            parent = (previous.block_id, previous.generation)
        block.token_ids = tuple(seq.block(index))
        block.hash = self._hash_fn(prefix_hash, block.token_ids)
        block.parent = parent
        self._hash_to_block_id[block.hash] = block.block_id
