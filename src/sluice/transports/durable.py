"""The Durable Streams protocol's wire rules, sans-IO: offsets, headers, JSON messages,
read bodies, SSE frames and cursors (``PROTOCOL.md`` of durable-streams/durable-streams,
v1.0; section numbers below are that document's).

Values in, bytes or values out; no I/O and no framework. The gateway
(:mod:`sluice.gateway.durable_streams`) applies them to requests; the write side's state
is :mod:`sluice.streams.durable`.

**Offsets** (section 8). The offset after event ``n`` of a log is ``NNNNNNNNNNNNNNNN_0000000000000000``:
``n`` in 16 decimal digits, an underscore, 16 zeros. Fixed width, so byte order is stream order;
``0000000000000000_0000000000000000`` is the start. For an LLM stream it names the same
position as the SSE id ``<stream_id>:<n>``, and an event id of the stream is accepted as an
offset there too, so a client may move between SSE, long-poll and Durable Streams reads.

Deliberate divergences from Sluice's own SSE (each forced by the protocol or its suite):

1. ``Content-Type: text/event-stream`` without ``charset`` (the suite compares it exactly).
2. ``data:`` lines carry no space after the colon, and a text payload's lines are split at
   CR, LF and CRLF (section 5.8), so CR-only input cannot forge an event boundary.
3. No ``id:`` lines and no ``retry:`` hint: the control event's ``streamNextOffset`` is the
   resume position, and clients reconnect with it.
"""

from __future__ import annotations

import base64
import datetime
import json
import re
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass

from sluice.errors import InvalidParameterError
from sluice.streams.durable import ProducerRequest, compact_json

__all__ = [
    "CURSOR_EPOCH_S",
    "CURSOR_INTERVAL_S",
    "MAX_SAFE_INTEGER",
    "NOW",
    "DurableOptions",
    "control_frame",
    "cursor_after",
    "data_frame",
    "essence",
    "format_offset",
    "is_json",
    "is_text",
    "json_messages",
    "parse_expires_at",
    "parse_offset",
    "parse_producer",
    "parse_ttl",
    "read_body",
    "strict_int",
]

# Section 10.1: cursors count 20-second intervals from 2024-10-09T00:00:00Z.
CURSOR_EPOCH_S = 1_728_432_000
CURSOR_INTERVAL_S = 20
# Section 10.1: a cursor echoed from the current interval (or later) is advanced by a jitter
# of 1-3600 s: here 1-180 intervals.
_MAX_JITTER_INTERVALS = 3600 // CURSOR_INTERVAL_S
# Section 5.2.1: producer epochs and sequences stay within JavaScript's safe integers.
MAX_SAFE_INTEGER = 2**53 - 1
# The ``offset=now`` sentinel (section 8), as :func:`parse_offset` returns it.
NOW = -1

_OFFSET = re.compile(r"([0-9]{16})_([0-9]{16})")
_DIGITS = re.compile(r"0|[1-9][0-9]*")
_LINE_BREAK = re.compile(r"\r\n|\r|\n")
_ZERO_PART = "0" * 16


@dataclass(frozen=True, slots=True)
class DurableOptions:
    """Server-side choices the protocol leaves to the implementation."""

    # A long-poll at the tail is held this long before its 204 (section 5.7); below the
    # 30-60 s idle timeouts of common proxies.
    long_poll_s: float = 20.0
    # An SSE response is closed after this long so CDNs can collapse (section 10.2, ~60 s).
    sse_connection_s: float = 60.0
    # A catch-up read returns at most this many bytes of payload (but always one record).
    max_read_bytes: int = 1024 * 1024

    def __post_init__(self) -> None:
        if not self.long_poll_s > 0 or not self.sse_connection_s > 0:
            raise ValueError("long_poll_s and sse_connection_s must be positive")
        if self.max_read_bytes < 1:
            raise ValueError("max_read_bytes must be positive")


# -- offsets --------------------------------------------------------------------------------


def format_offset(seq: int) -> str:
    """The offset after event ``seq`` (0: the start)."""
    return f"{seq:016d}_{_ZERO_PART}"


def parse_offset(text: str) -> int:
    """The event an ``offset`` names the position after: ``-1`` is 0 (the start), ``now``
    is :data:`NOW`; raises :class:`InvalidParameterError` for anything else malformed."""
    if text == "-1":
        return 0
    if text == "now":
        return NOW
    match = _OFFSET.fullmatch(text)
    if match is None or match.group(2) != _ZERO_PART:
        raise InvalidParameterError(f"offset: malformed offset {text[:80]!r}", "offset")
    return int(match.group(1))


# -- headers --------------------------------------------------------------------------------


def strict_int(text: str, name: str, maximum: int = MAX_SAFE_INTEGER) -> int:
    """A non-negative decimal integer without sign, leading zeros or exponent."""
    if _DIGITS.fullmatch(text) is None or int(text) > maximum:
        raise InvalidParameterError(f"{name}: not a non-negative integer: {text[:40]!r}", name)
    return int(text)


def parse_ttl(text: str) -> int:
    """``Stream-TTL`` (section 5.1): seconds, digits only."""
    return strict_int(text, "Stream-TTL")


def parse_expires_at(text: str) -> float:
    """``Stream-Expires-At`` (section 5.1): an RFC 3339 time, as Unix seconds."""
    try:
        when = datetime.datetime.fromisoformat(text.strip())
    except ValueError:
        raise InvalidParameterError(
            f"Stream-Expires-At: not an RFC 3339 time: {text[:60]!r}", "Stream-Expires-At"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    return when.timestamp()


def parse_producer(id: str | None, epoch: str | None, seq: str | None) -> ProducerRequest | None:
    """The three producer headers, all or none (``400`` otherwise)."""
    if id is None and epoch is None and seq is None:
        return None
    if id is None or epoch is None or seq is None:
        raise InvalidParameterError(
            "Producer-Id, Producer-Epoch and Producer-Seq go together", "Producer-Id"
        )
    if not id:
        raise InvalidParameterError("Producer-Id: empty", "Producer-Id")
    return ProducerRequest(id, strict_int(epoch, "Producer-Epoch"), strict_int(seq, "Producer-Seq"))


def essence(content_type: str) -> str:
    """A media type without parameters, lower-cased: what content types compare by."""
    return content_type.split(";", 1)[0].strip().lower()


def is_json(content_type: str) -> bool:
    """JSON mode (section 9.1)."""
    return essence(content_type) == "application/json"


def is_text(content_type: str) -> bool:
    """Whether SSE carries the payload as text (else base64, section 5.8)."""
    kind = essence(content_type)
    return kind.startswith("text/") or kind == "application/json"


# -- JSON mode ------------------------------------------------------------------------------


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def json_messages(body: bytes) -> list[bytes]:
    """The messages of a JSON append (section 9.1.2): a top-level array is flattened one
    level, any other value is one message; each is compact JSON. Raises ``ValueError`` for
    a body that is not UTF-8 JSON."""
    value = json.loads(body.decode("utf-8"), parse_constant=_no_constant)
    values = value if isinstance(value, list) else [value]
    return [compact_json(item) for item in values]


def read_body(payloads: Sequence[bytes], json_mode: bool) -> bytes:
    """A read's body: the records' bytes, or their messages as one JSON array."""
    if json_mode:
        return b"[" + b",".join(data for data in payloads if data) + b"]"
    return b"".join(payloads)


# -- SSE (section 5.8) ----------------------------------------------------------------------


def data_frame(body: bytes, content_type: str) -> bytes:
    """An ``event: data`` frame carrying a read's body (a JSON array in JSON mode, the
    text, or base64 for other content types)."""
    if is_text(content_type):
        text = body.decode("utf-8", errors="replace")
        lines = _LINE_BREAK.split(text)
    else:
        lines = [base64.b64encode(body).decode("ascii")]
    return ("event: data\n" + "".join(f"data:{line}\n" for line in lines) + "\n").encode()


def control_frame(next_offset: str, *, cursor: str | None, up_to_date: bool, closed: bool) -> bytes:
    """The ``event: control`` frame after data (or alone): the next offset, the cursor
    while the stream is open, ``upToDate`` and ``streamClosed``."""
    control: dict[str, object] = {"streamNextOffset": next_offset}
    if closed:
        control["streamClosed"] = True
        control["upToDate"] = True
    else:
        if cursor is not None:
            control["streamCursor"] = cursor
        if up_to_date:
            control["upToDate"] = True
    return f"event: control\ndata:{json.dumps(control, separators=(',', ':'))}\n\n".encode()


# -- cursors (section 10.1) -----------------------------------------------------------------


def cursor_after(client_cursor: str | None, now_s: float | None = None) -> str:
    """The cursor of a live response: the current interval, or, when the client's echoed
    cursor is not behind it, that cursor plus a random jitter (never backwards)."""
    now_s = time.time() if now_s is None else now_s
    interval = int(now_s - CURSOR_EPOCH_S) // CURSOR_INTERVAL_S
    if client_cursor is not None and _DIGITS.fullmatch(client_cursor) is not None:
        echoed = int(client_cursor)
        if echoed >= interval:
            return str(echoed + 1 + secrets.randbelow(_MAX_JITTER_INTERVALS))
    return str(interval)
