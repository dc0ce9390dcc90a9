"""A request as the block manager sees it: token ids, their logical blocks and a block table.

Token ids ``[0, num_tokens)`` are split into logical blocks of ``block_size`` tokens; logical
block ``i`` lives in physical block ``block_table[i]`` of the KV cache. The first
``num_cached_tokens`` tokens were found in the prefix cache and need no prefill; the first
``num_computed_tokens`` have their KV in the cache (the scheduler keeps this count). Nothing
here touches the KV cache itself; :class:`~sluice.engine.block_manager.BlockManager` fills
``block_table`` and ``num_cached_tokens``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

__all__ = ["Sequence", "SequenceStatus"]


class SequenceStatus(enum.Enum):
    """Where a request is in its life: queued, holding KV blocks, or done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """The token ids of one request and where their KV lives.

    ``token_ids`` holds the prompt followed by the completion tokens appended so far.
    Raises :class:`ValueError` for an empty prompt or a ``block_size`` below 1.
    """

    def __init__(self, seq_id: int, token_ids: Iterable[int], block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.seq_id = seq_id
        self.token_ids: list[int] = list(token_ids)
        if not self.token_ids:
            raise ValueError(f"sequence {seq_id} needs at least one prompt token")
        self.block_size = block_size
        self.num_prompt_tokens = len(self.token_ids)
        self.num_cached_tokens = 0
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        # Trailing blocks of the table past ``num_blocks``, for speculative tokens' K/V.
        self.num_lookahead_blocks = 0
        self.num_allocations = 0  # block tables it was given (a preempted one gets another)
        self.status = SequenceStatus.WAITING

    def __repr__(self) -> str:
        return (
            f"Sequence(seq_id={self.seq_id}, num_tokens={self.num_tokens}, "
            f"num_prompt_tokens={self.num_prompt_tokens}, block_table={self.block_table})"
        )

    @property
    def num_tokens(self) -> int:
        """Prompt plus completion tokens."""
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_blocks(self) -> int:
        """Logical blocks needed for ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
        return -(-self.num_tokens // self.block_size)

    @property
    def num_cached_blocks(self) -> int:
        """Leading blocks whose KV came from the prefix cache."""
        return self.num_cached_tokens // self.block_size

    @property
    def last_block_num_tokens(self) -> int:
        """Tokens in the last logical block, from 1 to ``block_size``."""
        return self.num_tokens - (self.num_blocks - 1) * self.block_size

    def block(self, index: int) -> list[int]:
        """Token ids of logical block ``index``; raises :class:`IndexError` when out of range."""
        if not 0 <= index < self.num_blocks:
            raise IndexError(
                f"block {index} out of range for sequence {self.seq_id} "
                f"with {self.num_blocks} blocks"
            )
        start = index * self.block_size
        return self.token_ids[start : start + self.block_size]

    def append_token(self, token_id: int) -> None:
        """Append one generated token; call ``BlockManager.append_slot`` right after."""
        self.token_ids.append(token_id)
