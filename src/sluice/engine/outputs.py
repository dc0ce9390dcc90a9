"""The engine's values: its limits (:class:`EngineConfig`), what a request gained in a step
(:class:`RequestOutput`) and what a step ran and cost (:class:`StepStats`). No torch, no
state: :mod:`sluice.engine.engine` uses them, the scheduler's config is derived here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sluice.engine.scheduler import SchedulerConfig

__all__ = ["EngineConfig", "FinishReason", "RequestOutput", "StepStats"]

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class EngineConfig:
    """Cache size and scheduling limits; :class:`ValueError` for any that cannot hold.

    ``max_model_len`` caps prompt plus completion tokens of one request; it must fit the
    KV cache (``num_blocks * block_size``) and, checked by :class:`Engine`, the model's
    positions.
    """

    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_waiting: int
    max_model_len: int
    chunked_prefill: bool = True

    def __post_init__(self) -> None:
        for name in (
            "num_blocks",
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_waiting",
        ):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.max_model_len > self.num_blocks * self.block_size:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the KV cache: "
                f"{self.num_blocks} blocks of {self.block_size} tokens"
            )

    @classmethod
    def for_serving(
        cls, n_positions: int, *, num_blocks: int, max_num_seqs: int, block_size: int = 16
    ) -> EngineConfig:
        """The limits a server runs a model of ``n_positions`` with (``sluice serve`` and
        ``sluice worker``): a step budget of 512 tokens, four waiting requests per running
        one, and a context of the model's positions or the whole cache, the lesser."""
        return cls(
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=512,
            max_waiting=4 * max_num_seqs,
            max_model_len=min(n_positions, num_blocks * block_size),
        )

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_waiting=self.max_waiting,
            block_size=self.block_size,
            chunked_prefill=self.chunked_prefill,
        )


@dataclass(frozen=True)
class StepStats:
    """What one step ran and how long it took: ``num_prefill_tokens`` prompt (or recompute)
    tokens, ``num_decodes`` decoding sequences, in ``duration_s`` seconds. With speculation
    the decodes also verified ``num_speculative_tokens`` drafted tokens and emitted
    ``num_decode_tokens`` tokens in all (without, one each)."""

    num_prefill_tokens: int
    num_decodes: int
    duration_s: float
    num_speculative_tokens: int = 0
    num_decode_tokens: int | None = None  # None: num_decodes

    @property
    def tokens_per_decode(self) -> float:
        """Tokens each decoding sequence gained, on average (1 without speculation)."""
        if self.num_decode_tokens is None or self.num_decodes == 0:
            return 1.0
        return self.num_decode_tokens / self.num_decodes


@dataclass(frozen=True)
class RequestOutput:
    """What one request gained in one step.

    ``new_text`` is the text released this step (held-back text that may begin a stop
    string comes later, or never). ``logprobs`` holds one logprob per new token when the
    request asked for them, else None. ``stop_sequence`` is the stop string that finished
    the request, when one did.

    ``error`` is set when the engine failed this request alone (its row could not be
    sampled, detokenized or checked): a message for its client, with ``finished`` true,
    ``finish_reason`` None and no new tokens; the request is already aborted.
    """

    request_id: int
    new_text: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_completion_tokens: int
    num_cached_tokens: int
    logprobs: tuple[float, ...] | None = None
    produced_at: float = 0.0  # time.monotonic() when its step sampled it
    stop_sequence: str | None = None
    error: str | None = None
