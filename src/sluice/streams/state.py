"""The stream state machine: one table, illegal transitions raise.

::

    queued ──► running ──► finished
       │          ├──────► cancelled
       │          └──────► failed
       ├─────────────────► cancelled
       └─────────────────► failed
"""

from __future__ import annotations

import enum

from sluice.errors import IllegalTransitionError

__all__ = ["TERMINAL_STATES", "TRANSITIONS", "StreamState", "next_state"]


class StreamState(enum.StrEnum):
    """Where a stream is in its life."""

    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"


TRANSITIONS: dict[StreamState, frozenset[StreamState]] = {
    StreamState.QUEUED: frozenset({StreamState.RUNNING, StreamState.CANCELLED, StreamState.FAILED}),
    StreamState.RUNNING: frozenset(
        {StreamState.FINISHED, StreamState.CANCELLED, StreamState.FAILED}
    ),
    StreamState.FINISHED: frozenset(),
    StreamState.CANCELLED: frozenset(),
    StreamState.FAILED: frozenset(),
}

TERMINAL_STATES = frozenset(state for state, targets in TRANSITIONS.items() if not targets)


def next_state(stream_id: str, current: StreamState, target: StreamState) -> StreamState:
    """Return ``target`` if the table allows ``current -> target``, else raise."""
    if target not in TRANSITIONS[current]:
        raise IllegalTransitionError(stream_id, current.value, target.value)
    return target
