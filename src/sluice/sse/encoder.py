"""Frame values as ``text/event-stream`` bytes: the server side of the SSE wire format.

Each function is pure and returns UTF-8 bytes that can be written to a socket as they are
made and concatenated freely (WHATWG HTML §9.2.5 "Parsing an event stream":
``stream = [ bom ] *event``, ``event = *( comment / field ) end-of-line``): an event or a
``retry`` field is a complete block that ends in a blank line; a comment is comment lines
only, which belong to whatever block follows them (choice 6).

Choices made here, each so that what :class:`sluice.sse.Decoder` (or a browser) reads
back equals what was written:

1. Fields are written as ``name: value`` with exactly one space. A parser removes one
   leading space from a value (§9.2.6), so a value that itself starts with a space
   survives.
2. ``data`` containing CRLF, CR or LF is written as one ``data:`` line per line, because
   all three end a line on the wire (§9.2.5). The decoder joins them back with LF, so
   ``"a\\r\\nb"`` reads back as ``"a\\nb"``. Only these three characters split: unlike
   ``str.splitlines``, VT, FF, NEL and U+2028 are ordinary data.
3. ``id`` may not contain CR or LF (they would end the field early) nor NUL (a parser
   ignores an ``id`` field containing NUL, §9.2.6). ``event`` may not contain CR or LF.
   Both are refused with :class:`~sluice.errors.SSEEncodeError` rather than silently
   altered.
4. An empty ``id`` is written (``id: ``): it is how a server resets the client's last
   event ID (§9.2.6, the ``id`` field sets the buffer to the value, empty or not).
5. Text that cannot be encoded as UTF-8 (a lone surrogate) is refused with
   :class:`~sluice.errors.SSEEncodeError`; the stream is UTF-8 only (§9.2.5).
6. A comment (a heartbeat) is written as comment lines with NO blank line after them
   (``: ping\n``). §9.2.6 ignores a line that starts with a colon and dispatches only on
   a blank line, so by the spec the comment simply joins the next event's block (the
   grammar's ``event = *( comment / field ) end-of-line``) and changes nothing; at the end
   of the stream a block without its blank line is discarded (§9.2.5), and a comment has
   nothing to lose. A blank line after the comment would be harmless to a browser (an
   empty data buffer dispatches nothing, §9.2.6 dispatch step 2) but not to parsers that
   dispatch on every blank line once an ``id`` was seen: the Stainless ``SSEDecoder`` of
   the ``openai`` and ``anthropic`` Python SDKs (and LangChain and LiteLLM on top of
   them), ``httpx-sse`` and ``fetch-event-source`` turn ``: ping\n\n`` into an event with
   empty data, which the SDKs then fail to parse as JSON. A bare comment line is
   invisible to all of them.
"""

from __future__ import annotations

from sluice.errors import SSEEncodeError

__all__ = ["EventEncoder", "encode_comment", "encode_event", "encode_retry"]


def _normalise_line_ends(text: str) -> str:
    """Turn every CRLF and lone CR into LF, the three line ends of §9.2.5."""
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _encode(frame: str, what: str) -> bytes:
    try:
        return frame.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise SSEEncodeError(f"SSE {what} is not encodable as UTF-8: {exc.reason}") from exc


def _check_id(id: str) -> None:
    # §9.2.6: CR or LF would end the line early; a NUL makes the client ignore the field.
    if "\r" in id or "\n" in id or "\0" in id:
        raise SSEEncodeError(f"SSE id may not contain CR, LF or NUL: {id!r}")


def _check_event(event: str) -> None:
    # §9.2.5: CR or LF would end the line and turn the rest into another field.
    if "\r" in event or "\n" in event:
        raise SSEEncodeError(f"SSE event type may not contain CR or LF: {event!r}")


def encode_event(data: str, *, event: str | None = None, id: str | None = None) -> bytes:
    """Frame one event: ``id:`` (if given), ``event:`` (if given), ``data:`` lines, blank line.

    ``encode_event("")`` is ``b"data: \\n\\n"``: one empty ``data`` field makes the data
    buffer ``"\\n"``, which is not empty, so the client dispatches an event whose data is
    ``""`` (§9.2.6).

    Raises :class:`~sluice.errors.SSEEncodeError` for an ``id`` containing CR, LF or NUL,
    an ``event`` containing CR or LF, or text that is not encodable as UTF-8.
    """
    # Hot path: called once per generated token, which almost never holds a line end, and
    # nearly always with both an id and an event name: one f-string, one encode.
    if "\n" in data or "\r" in data:
        data = _normalise_line_ends(data).replace("\n", "\ndata: ")
    if id is not None:
        _check_id(id)
        if event is not None:
            _check_event(event)
            frame = f"id: {id}\nevent: {event}\ndata: {data}\n\n"
        else:
            frame = f"id: {id}\ndata: {data}\n\n"
    elif event is not None:
        _check_event(event)
        frame = f"event: {event}\ndata: {data}\n\n"
    else:
        frame = f"data: {data}\n\n"
    try:
        return frame.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise SSEEncodeError(f"SSE event is not encodable as UTF-8: {exc.reason}") from exc


class EventEncoder:
    """:func:`encode_event` for many events of one type, checked once (the token hot path).

    ``EventEncoder("token")(data, id)`` returns exactly
    ``encode_event(data, event="token", id=id)``; only ``data`` and ``id`` are checked per
    call, since the type cannot change.
    """

    __slots__ = ("_event",)

    def __init__(self, event: str) -> None:
        _check_event(event)
        self._event = event

    def __call__(self, data: str, id: str) -> bytes:
        if "\n" in data or "\r" in data:
            return encode_event(data, event=self._event, id=id)
        _check_id(id)
        try:
            return f"id: {id}\nevent: {self._event}\ndata: {data}\n\n".encode()
        except UnicodeEncodeError as exc:
            raise SSEEncodeError(f"SSE event is not encodable as UTF-8: {exc.reason}") from exc


def encode_comment(text: str = "") -> bytes:
    """Comment lines, which clients ignore (§9.2.6: a line starting with a colon), with no
    blank line after them (choice 6): they may go wherever a line begins, such as between
    two blocks, where the transports write heartbeats.

    ``encode_comment()`` is ``b":\\n"``, the smallest keep-alive; ``"ping"`` gives
    ``b": ping\\n"``. Text with CR or LF becomes several comment lines.
    """
    if not text:
        return b":\n"
    if "\n" in text or "\r" in text:
        lines = _normalise_line_ends(text).split("\n")
        frame = "".join(f": {line}\n" if line else ":\n" for line in lines)
    else:
        frame = f": {text}\n"
    return _encode(frame, "comment")


def encode_retry(retry_ms: int) -> bytes:
    """Frame a ``retry`` field: the client's reconnection time in milliseconds (§9.2.6).

    A client ignores a ``retry`` value that is not all ASCII digits, so anything that
    would not be written as such is refused with :class:`~sluice.errors.SSEEncodeError`:
    a non-``int``, a ``bool``, or a negative number.
    """
    if isinstance(retry_ms, bool) or not isinstance(retry_ms, int):
        raise SSEEncodeError(f"SSE retry must be an int of milliseconds, not {retry_ms!r}")
    if retry_ms < 0:
        raise SSEEncodeError(f"SSE retry must not be negative: {retry_ms}")
    return f"retry: {int(retry_ms)}\n\n".encode("ascii")
