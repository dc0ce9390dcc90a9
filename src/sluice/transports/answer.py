"""What a request handler gives a transport to write: a whole response, or a stream.

The gateway's handlers (the SSE reads, the compatible APIs) return an :data:`Answer`
instead of writing it, so one handler serves every shell: :func:`send_answer` writes it as
a plain ASGI response, the native HTTP/1.1 path (:mod:`sluice.transports.http1`) writes it
to its transport with the same delivery core.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sluice.streams.reader import Reader
from sluice.transports.asgi import Receive, Scope, Send
from sluice.transports.delivery import DeliveryOptions
from sluice.transports.frames import FrameSource
from sluice.transports.sse import send_event_stream

__all__ = ["Answer", "Streamed", "Whole", "send_answer"]

Header = tuple[bytes, bytes]


@dataclass(frozen=True, slots=True)
class Whole:
    """A response written in one go. ``headers`` have lower-case names; a
    ``content-length`` is added where the status allows a body and none is given."""

    status: int
    headers: Sequence[Header] = ()
    body: bytes = b""

    def with_length(self) -> list[Header]:
        """The headers, with ``content-length`` (RFC 9110 section 8.6: never on a 204)."""
        headers = list(self.headers)
        if self.status != 204 and not any(name == b"content-length" for name, _ in headers):
            headers.append((b"content-length", str(len(self.body)).encode()))
        return headers


@dataclass(frozen=True, slots=True, eq=False)
class Streamed:
    """An SSE response: the reader's records as ``frames`` renders them, after SSE's own
    headers and ``headers``. Whoever gets one must write it or close its reader."""

    reader: Reader
    frames: FrameSource
    headers: Sequence[Header] = ()


Answer = Whole | Streamed


async def send_answer(
    answer: Answer, scope: Scope, receive: Receive, send: Send, options: DeliveryOptions
) -> None:
    """Write ``answer`` as a plain ASGI response."""
    if isinstance(answer, Streamed):
        await send_event_stream(
            receive, send, answer.reader, answer.frames, options, extra_headers=answer.headers
        )
        return
    await send(
        {"type": "http.response.start", "status": answer.status, "headers": answer.with_length()}
    )
    await send({"type": "http.response.body", "body": answer.body})
