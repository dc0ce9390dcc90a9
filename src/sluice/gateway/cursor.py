"""Where a native read of a stream may start: the checks every JSON transport makes
before it opens a reader (long-poll, WebSocket), as the SSE read makes them
(:mod:`sluice.gateway.streaming`).

A cursor ``<stream_id>:<n>`` past the stream's last event is refused (``400``); one at
or after the terminal event leaves nothing to read (the SSE read's ``204``); one the log
no longer holds is a :class:`~sluice.errors.ResumeGapError` (``410``). Otherwise a reader
opens after event ``n``: the hub counts it as the stream's reader (the grace window
stops) until it is closed.
"""

from __future__ import annotations

from sluice.errors import BadEventIdError, ResumeGapError
from sluice.observability.metrics import Metrics
from sluice.streams.hub import Stream, StreamHub
from sluice.streams.reader import Reader

__all__ = ["open_reader_at", "readable_after"]


def readable_after(hub: StreamHub, stream: Stream, after_seq: int, metrics: Metrics) -> bool:
    """Whether a reader of ``stream`` after event ``after_seq`` has anything to read: False
    once the stream ended and the position has it all. Raises :class:`BadEventIdError`
    for a position past the stream's last event and :class:`ResumeGapError` (counted) for
    one the log no longer holds. Every transport's reads (SSE, long-poll, WebSocket, gRPC)
    check their position here."""
    log = hub.log
    last_seq = log.last_seq(stream.id)
    if after_seq > last_seq:
        raise BadEventIdError(
            f"the position names event {after_seq}, but stream {stream.id} has {last_seq}"
        )
    if stream.is_terminal and after_seq >= last_seq:
        return False
    try:
        log.read(stream.id, after_seq, 1)  # is the position still retained?
    except ResumeGapError:
        metrics.resume_gaps.inc()
        raise
    return True


def open_reader_at(
    hub: StreamHub, metrics: Metrics, stream: Stream, after_seq: int
) -> Reader | None:
    """A reader of ``stream`` after event ``after_seq``; ``None`` when nothing is left
    (the stream ended at or before it). Raises as :func:`readable_after` does."""
    if not readable_after(hub, stream, after_seq, metrics):
        return None
    return hub.open_reader(stream.id, after_seq)
