"""Read ``text/event-stream`` bytes into :class:`~sluice.sse.Event` values, sans-IO.

:class:`Decoder` is the client side of the SSE wire format, for reading upstream servers
(LLM backends, other gateways). It never reads a socket: ``feed(bytes)`` buffers and
returns the events that chunk completed, ``close()`` marks the end of the stream. It
implements WHATWG HTML §9.2.5 "Parsing an event stream" and §9.2.6 "Interpreting an
event stream"; each rule is cited beside the code that implements it.

Deliberate divergences from the spec, each with its reason:

1. **Bounded lines.** The spec puts no limit on a line. A line longer than
   ``max_line_bytes`` (excluding its line end) raises
   :class:`~sluice.errors.LineTooLongError` and the decoder refuses further input, so a
   broken or hostile upstream cannot make it buffer without end. The check is by line,
   not by chunk, so the outcome does not depend on how the bytes were split.
2. **No reconnection.** At end of stream a browser's ``EventSource`` reconnects after
   the reconnection time; ``close()`` only discards the incomplete event (as §9.2.5
   requires at end of file) and returns. Reconnecting is the caller's business.
3. **``retry`` is exposed, not acted on.** A valid ``retry`` field sets
   :attr:`Decoder.retry_ms` (``None`` until one arrives); nothing waits on it. Values
   above :data:`MAX_RETRY_MS` are ignored, like any other invalid ``retry`` value.
4. **The ID is exposed.** :attr:`Decoder.last_event_id` is the event source's "last
   event ID string" (§9.2.6 dispatch step 1), the value a reconnecting client sends as
   ``Last-Event-ID``. Like a browser's, it moves only when an event is dispatched (by a
   blank line), so an ``id`` in an event cut off by the end of the stream never counts.
5. **Bounded events.** The data buffer of one event is bounded too: past
   ``max_event_chars`` characters of data the decoder raises
   :class:`~sluice.errors.EventTooLargeError` and refuses further input, so many short
   ``data:`` lines without a blank line cannot grow it without end either.
6. **No origin, no ``MessageEvent``.** Events are plain frozen values; the origin and
   the task queue of §9.2.6 steps 5 and 8 belong to a browser.
"""

from __future__ import annotations

import re
from typing import NoReturn

from sluice.errors import ConfigError, EventTooLargeError, LineTooLongError, SSEDecodeError
from sluice.sse.event import Event

__all__ = ["DEFAULT_MAX_EVENT_CHARS", "DEFAULT_MAX_LINE_BYTES", "MAX_RETRY_MS", "Decoder"]

# One line may be a whole event's data (a JSON chunk from an LLM server, with logprobs or a
# tool call); 1 MiB is far above any such line yet small enough that one stream cannot
# hold much memory hostage while waiting for a line end. Divergence 1.
DEFAULT_MAX_LINE_BYTES: int = 1 << 20

# An event's data may span many lines; 16 Mi characters holds any single LLM chunk (a
# whole non-streamed completion with logprobs) while bounding what one event can pin.
# Divergence 5.
DEFAULT_MAX_EVENT_CHARS: int = 16 << 20

# The spec sets no bound on ``retry``. Python refuses ``int()`` of very long digit strings,
# and no reconnection delay needs more than an unsigned 64-bit count of milliseconds
# (half a billion years), so larger values are ignored. Divergence 3.
MAX_RETRY_MS: int = (1 << 64) - 1
_MAX_RETRY_DIGITS = len(str(MAX_RETRY_MS))

# §9.2.5 via the Encoding Standard's "UTF-8 decode": one leading BOM is stripped.
_BOM = b"\xef\xbb\xbf"
_CR = 0x0D
_LF = 0x0A
# §9.2.5: a line ends with CRLF, a lone LF, or a lone CR. One search finds either byte.
_LINE_END = re.compile(rb"[\r\n]")


def _parse_retry(value: str) -> int | None:
    """A ``retry`` value in milliseconds, or ``None`` when the field must be ignored.

    §9.2.6: "If the field value consists of only ASCII digits, then interpret the field
    value as an integer in base ten, and set the event stream's reconnection time to that
    integer. Otherwise, ignore the field." An empty value has no digits, so it is ignored.
    Values above :data:`MAX_RETRY_MS` are ignored too (divergence 3).
    """
    if not (value.isascii() and value.isdigit()):
        return None
    significant = value.lstrip("0") or "0"
    if len(significant) > _MAX_RETRY_DIGITS:
        return None  # Checked before int(), which refuses very long digit strings.
    retry_ms = int(significant)
    return retry_ms if retry_ms <= MAX_RETRY_MS else None


class Decoder:
    """An incremental, sans-IO ``text/event-stream`` parser.

    Feed it byte chunks as they arrive, however they are split; each ``feed`` returns
    the events completed so far, in order. Call ``close`` at end of stream. After
    ``close`` or an error, ``feed`` raises :class:`~sluice.errors.SSEDecodeError`.
    """

    __slots__ = (
        "_bom_pending",
        "_buffer",
        "_closed",
        "_data_chars",
        "_data_lines",
        "_error",
        "_event_type",
        "_last_event_id",
        "_last_event_id_buffer",
        "_max_event_chars",
        "_max_line_bytes",
        "_retry_ms",
        "_scan_pos",
        "_skip_lf",
    )

    def __init__(
        self,
        *,
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
        max_event_chars: int = DEFAULT_MAX_EVENT_CHARS,
    ) -> None:
        for name, bound in (
            ("max_line_bytes", max_line_bytes),
            ("max_event_chars", max_event_chars),
        ):
            if isinstance(bound, bool) or not isinstance(bound, int):
                raise ConfigError(f"{name} must be an int, not {bound!r}")
            if bound < 1:
                raise ConfigError(f"{name} must be at least 1, not {bound}")
        self._max_line_bytes = max_line_bytes
        self._max_event_chars = max_event_chars
        # Bytes not yet split into lines: at most one incomplete line after each feed().
        self._buffer = bytearray()
        # Bytes of _buffer before this index hold no CR or LF (no re-scan per byte fed).
        self._scan_pos = 0
        # True until the first three bytes are known: they may be a BOM (§9.2.5).
        self._bom_pending = True
        # True when the last chunk ended in CR: an LF next completes that CRLF (§9.2.5).
        self._skip_lf = False
        # §9.2.5: "a data buffer, an event type buffer, and a last event ID buffer", all
        # initially empty. The data buffer is kept as its values, joined at dispatch; it
        # is empty exactly when this list is.
        self._data_lines: list[str] = []
        self._data_chars = 0  # characters in the data buffer, LFs included (divergence 5)
        self._event_type = ""
        self._last_event_id_buffer = ""
        # §9.2.6 dispatch step 1: the event source's "last event ID string".
        self._last_event_id = ""
        self._retry_ms: int | None = None
        self._closed = False
        self._error: SSEDecodeError | None = None

    @property
    def last_event_id(self) -> str:
        """The last event ID as of the latest dispatch (what to send as ``Last-Event-ID``)."""
        return self._last_event_id

    @property
    def retry_ms(self) -> int | None:
        """The last valid ``retry`` value seen, in milliseconds; ``None`` if none yet."""
        return self._retry_ms

    def feed(self, data: bytes) -> list[Event]:
        """Buffer ``data`` and return the events it completed, in stream order.

        Raises :class:`~sluice.errors.LineTooLongError` when a line passes
        ``max_line_bytes``, :class:`~sluice.errors.EventTooLargeError` when an event's data
        passes ``max_event_chars``, and :class:`~sluice.errors.SSEDecodeError` when called after
        ``close()`` or after an error.
        """
        if self._error is not None:
            raise SSEDecodeError("SSE decoder is unusable after an earlier error") from (
                self._error
            )
        if self._closed:
            raise SSEDecodeError("SSE decoder fed after close()")
        buffer = self._buffer
        if not buffer and self._plain_state():
            event = self._whole_data_event(data)
            if event is not None:
                return [event]
        buffer += data
        start = 0
        if self._bom_pending:
            if len(buffer) < len(_BOM) and _BOM.startswith(buffer):
                return []  # Could still be a BOM; wait for more bytes.
            self._bom_pending = False
            if buffer.startswith(_BOM):
                start = len(_BOM)
        if self._skip_lf and len(buffer) > start:
            self._skip_lf = False
            if buffer[start] == _LF:
                start += 1  # The second half of a CRLF split across two chunks.
        events: list[Event] = []
        pos = max(self._scan_pos, start)
        max_line_bytes = self._max_line_bytes
        while (match := _LINE_END.search(buffer, pos)) is not None:
            end = match.start()
            if end - start > max_line_bytes:
                self._fail(LineTooLongError(max_line_bytes))
            line = buffer[start:end].decode("utf-8", "replace")  # §9.2.5: UTF-8 decode.
            if buffer[end] == _CR:
                if end + 1 == len(buffer):
                    self._skip_lf = True  # Decide on the next chunk; the line ends here.
                    pos = end + 1
                elif buffer[end + 1] == _LF:
                    pos = end + 2
                else:
                    pos = end + 1
            else:
                pos = end + 1
            start = pos
            event = self._process_line(line)
            if event is not None:
                events.append(event)
        del buffer[:start]  # One move per chunk, not per line.
        self._scan_pos = len(buffer)
        if len(buffer) > max_line_bytes:
            self._fail(LineTooLongError(max_line_bytes))
        return events

    def _plain_state(self) -> bool:
        """Between events, with nothing pending: where the fast path may start."""
        return not (self._data_lines or self._event_type or self._bom_pending or self._skip_lf)

    def _whole_data_event(self, data: bytes) -> Event | None:
        """The fast path for the commonest chunk, one whole ``data: X\\n\\n`` event: the
        event the line-by-line path would dispatch (same limits), or ``None`` to take
        that path."""
        if not (data.startswith(b"data: ") and data.endswith(b"\n\n")) or data.count(b"\n") != 2:
            return None
        if b"\r" in data or len(data) - 2 > self._max_line_bytes:
            return None  # other line ends, or a too-long line: the general path decides
        value = data[6:-2].decode("utf-8", "replace")
        if len(value) + 1 > self._max_event_chars:
            return None
        self._last_event_id = self._last_event_id_buffer  # as _dispatch does
        return Event(data=value, event="message", id=self._last_event_id)

    def close(self) -> list[Event]:
        """Mark the end of the stream and discard any incomplete event.

        §9.2.5: "Once the end of the file is reached, any pending data must be
        discarded", so an event without its blank line, or a last line without its line
        end, is never dispatched. Returns ``[]``; it is a list for symmetry with
        ``feed``. Calling it again does nothing.
        """
        self._closed = True
        self._buffer.clear()
        self._scan_pos = 0
        self._data_lines.clear()
        self._event_type = ""
        return []

    def _fail(self, error: SSEDecodeError) -> NoReturn:
        """Drop everything buffered and refuse further input (divergences 1 and 5)."""
        self._buffer.clear()
        self._scan_pos = 0
        self._data_lines.clear()
        self._data_chars = 0
        self._error = error
        raise error

    def _process_line(self, line: str) -> Event | None:
        """Apply one decoded line, without its line end; §9.2.6."""
        if not line:
            return self._dispatch()  # "If the line is empty (a blank line)".
        if line[0] == ":":
            return None  # "If the line starts with a U+003A COLON character (:)": ignore.
        # "If the line contains a U+003A COLON character": field before the first colon,
        # value after it, less one leading U+0020 SPACE. "Otherwise": the whole line is
        # the field name and the value is empty (partition gives exactly that).
        field, _, value = line.partition(":")
        if value[:1] == " ":
            value = value[1:]
        self._process_field(field, value)
        return None

    def _process_field(self, field: str, value: str) -> None:
        """§9.2.6 "process the field"; unknown field names are ignored."""
        if field == "data":
            # "Append the field value to the data buffer, then append a single U+000A
            # LINE FEED (LF) character" (the LFs are added by the join at dispatch).
            self._data_chars += len(value) + 1
            if self._data_chars > self._max_event_chars:
                self._fail(EventTooLargeError(self._max_event_chars))
            self._data_lines.append(value)
        elif field == "event":
            self._event_type = value  # "Set the event type buffer to field value."
        elif field == "id":
            # "If the field value does not contain U+0000 NULL, then set the last event
            # ID buffer to the field value. Otherwise, ignore the field."
            if "\0" not in value:
                self._last_event_id_buffer = value
        elif field == "retry":
            retry_ms = _parse_retry(value)
            if retry_ms is not None:
                self._retry_ms = retry_ms

    def _dispatch(self) -> Event | None:
        """§9.2.6 "dispatch the event", for a blank line."""
        # Step 1: the last event ID buffer is not reset, so the ID persists.
        self._last_event_id = self._last_event_id_buffer
        # Step 2: with an empty data buffer, reset the buffers and dispatch nothing.
        if not self._data_lines:
            self._event_type = ""
            return None
        self._data_chars = 0
        # Steps 3-6: data without its final LF; type "message" unless the buffer says so.
        event = Event(
            data="\n".join(self._data_lines),
            event=self._event_type or "message",
            id=self._last_event_id,
        )
        # Step 7: reset the data and event type buffers.
        self._data_lines.clear()
        self._event_type = ""
        return event
