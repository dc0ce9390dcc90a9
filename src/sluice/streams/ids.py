"""Stream ids and event ids.

A stream id is 128 random bits in base62 behind a ``str_`` prefix. Event ``n`` of a stream
(numbered from 1) has the SSE id ``<stream_id>:<n>``, so a ``Last-Event-ID`` alone names both
the stream and the position to resume after.

A dialect that renders one event as several SSE frames (Anthropic's ``content_block_start``
then ``content_block_delta``; OpenAI's finish chunk, usage chunk and ``[DONE]``) ids the last
frame ``<stream_id>:<n>`` and frame ``k`` before it (from 1) ``<stream_id>:<n-1>.<k>``:
"event ``n-1`` and ``k`` frames of the next", so a drop between two frames of one event
resumes without repeating the frames already received.
"""

from __future__ import annotations

import re
import secrets

from sluice.errors import BadEventIdError

__all__ = [
    "MAX_EVENT_ID_CHARS",
    "event_id",
    "is_stream_id",
    "new_stream_id",
    "parse_event_id",
    "parse_position",
]

_ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_PREFIX = "str_"
_ID_CHARS = 22  # 62**22 > 2**128, so 22 base62 digits hold 128 bits
_STREAM_ID = re.compile(r"str_[0-9A-Za-z]{22}")
_EVENT_ID = re.compile(r"(str_[0-9A-Za-z]{22}):(0|[1-9][0-9]{0,17})(?:\.([1-9][0-9]{0,3}))?")
# A Last-Event-ID is a stream id, a colon and a sequence number; anything much longer is not ours.
MAX_EVENT_ID_CHARS = 64


def new_stream_id() -> str:
    """A fresh stream id: ``str_`` + 128 random bits in base62."""
    n = secrets.randbits(128)
    digits = []
    for _ in range(_ID_CHARS):
        n, r = divmod(n, 62)
        digits.append(_ALPHABET[r])
    return _PREFIX + "".join(digits)


def is_stream_id(text: str) -> bool:
    """True when ``text`` has the shape of a stream id (it may still be unknown)."""
    return _STREAM_ID.fullmatch(text) is not None


def event_id(stream_id: str, seq: int) -> str:
    """The SSE id of event ``seq`` of ``stream_id``."""
    return f"{stream_id}:{seq}"


def parse_event_id(text: str) -> tuple[str, int]:
    """Split a ``Last-Event-ID`` into ``(stream_id, seq)``; raise :class:`BadEventIdError`
    (also for a frame id ``<n>.<k>``, which only dialect streams use)."""
    stream_id, seq, frames = parse_position(text)
    if frames:
        raise BadEventIdError(f"malformed Last-Event-ID {text!r}: not an event id")
    return stream_id, seq


def parse_position(text: str) -> tuple[str, int, int]:
    """Split a ``Last-Event-ID`` into ``(stream_id, seq, frames)``: after event ``seq`` and
    ``frames`` frames of the next one; raise :class:`BadEventIdError`."""
    if len(text) > MAX_EVENT_ID_CHARS:
        raise BadEventIdError(f"Last-Event-ID is longer than {MAX_EVENT_ID_CHARS} characters")
    match = _EVENT_ID.fullmatch(text)
    if match is None:
        raise BadEventIdError(
            f"malformed Last-Event-ID {text!r}: expected '<stream id>:<event number>'"
        )
    return match.group(1), int(match.group(2)), int(match.group(3) or 0)
