"""One WebSocket's streams over ASGI: a thin shell around the delivery core.

Each subscription of a socket is a delivery core (:class:`~sluice.transports.delivery.Delivery`)
driven by callbacks, exactly as the native SSE path drives it
(:class:`~sluice.transports.sse.CallbackSSE`: the log wakes it, one timer serves its send
timeout), with its messages (:class:`~sluice.transports.websocket_protocol.WebSocketFrames`)
written into the socket's one bounded send queue.

The queue goes to the socket as the native HTTP/1.1 path's bodies do
(:mod:`sluice.transports.http1.write_batch`): what the subscriptions queued in one loop
pass (a token each, appended by the engine's step) is sent at the start of the next, in
one write, one text frame per message (:data:`SEND_TEXTS` where the server has it, else
one ASGI ``websocket.send`` per message). The send is run in that callback
(:func:`~sluice.transports.websocket_eager.start_eagerly`): it nearly always completes
there (the transport's buffer has room), so a token costs no task wake. A send that has
to wait for the socket is finished by the sender task, which then sends what queued
meanwhile; until it has, nothing else is sent.

Two tasks per socket, in one task group: that sender, and the receiver, which reads the
client's messages and hands each to the gateway's handler, one at a time.

Backpressure and the slow-client policy, as on SSE:

- When the queue holds :attr:`~WebSocketLimits.max_queued_messages`, every subscription
  of the socket is paused (its core stops reading the log and, when it resumes, coalesces
  the tokens it missed into one message); they resume, in turn from a different one each
  time, when the sender has drained the queue to
  :attr:`~WebSocketLimits.resume_queued_messages`. The queue so holds at most the bound
  plus one delivery batch per subscription.
- The receiver answers a client message only while the queue is below its bound, and reads
  the next one only after: a client that sends without reading fills its own TCP window,
  not the server's memory.
- A subscription paused for the send timeout ends unclean, its reader leaves (so a
  non-resumable stream without readers is cancelled at once, a resumable one gets its
  grace window) and the socket is closed: ``1013`` (try again later; the client resumes
  from its last id on a new socket), or ``1008`` when a stream it read was not resumable.
  A close frame that cannot go out within :attr:`~WebSocketLimits.close_timeout_s` is
  given up on: the handler returns and the server closes the connection.
- The core's heartbeats are not sent: the server's WebSocket pings keep the socket alive.

When the socket closes, every subscription detaches (as when an SSE client leaves): the
same grace and cancel rules apply.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from sluice.streams.reader import Reader
from sluice.transports.asgi import Receive, Scope, Send
from sluice.transports.delivery import Delivery, DeliveryOptions
from sluice.transports.frames import FrameSource
from sluice.transports.sse import CallbackSSE
from sluice.transports.websocket_eager import Rest, start_eagerly
from sluice.transports.websocket_protocol import (
    CLOSE_NOT_RESUMABLE,
    CLOSE_TRY_AGAIN,
    WebSocketFrames,
    WebSocketLimits,
    error_message,
    split_messages,
)

__all__ = [
    "SEND_TEXTS",
    "ErrorEncoder",
    "MessageHandler",
    "SendTexts",
    "WebSocketSession",
    "texts_sender",
]

SEND_TEXTS = "sluice.websocket.send_texts"
"""The ASGI extension of a server that writes several text messages at once: its value's
``send`` takes a list of UTF-8 messages, sends each as one text frame, all in one write
(``sluice serve``'s uvicorn protocol has it: :mod:`sluice.transports.http1.uvicorn_adapter`)."""

SendTexts = Callable[[list[bytes]], Awaitable[None]]
"""Send each message (UTF-8 bytes) as one text frame of the socket, in order."""

# The most messages one write of a socket carries (64 tokens' messages: ~10 KB).
_MAX_BATCH = 64

MessageHandler = Callable[["WebSocketSession", str], Awaitable[None]]
"""What the gateway does with one client text message (it answers through the session)."""

ErrorEncoder = Callable[[str, str, "str | None"], bytes]
"""The session's own refusals (a binary message, a subscription ended early) as a message
of the socket's protocol: ``(code, message, stream_id)``."""

_COMMENT = b":"  # the core's heartbeat is an SSE comment line: not sent here
_END = b"\n"  # ends each message of a subscription's body (see split_messages)


def texts_sender(scope: Scope, send: Send) -> SendTexts:
    """The server's batch sender where it has one (:data:`SEND_TEXTS`), else one ASGI
    ``websocket.send`` per message."""
    extension = scope.get("extensions", {}).get(SEND_TEXTS)
    if extension is not None:
        batch_send: SendTexts = extension["send"]
        return batch_send

    async def send_each(messages: list[bytes]) -> None:
        for message in messages:
            await send({"type": "websocket.send", "text": message.decode()})

    return send_each


@dataclass(slots=True)
class _Subscription:
    shell: CallbackSSE
    resumable: bool


class WebSocketSession:
    """One accepted WebSocket: its subscriptions, send queue and two tasks."""

    __slots__ = (
        "_close_code",
        "_closed",
        "_ended",
        "_errors",
        "_failure",
        "_flush_due",
        "_limits",
        "_loop",
        "_options",
        "_paused",
        "_queue",
        "_room",
        "_send",
        "_send_texts",
        "_sender_wake",
        "_subscriptions",
        "_turn",
        "_waiting_send",
    )

    def __init__(
        self,
        scope: Scope,
        send: Send,
        options: DeliveryOptions,
        limits: WebSocketLimits,
        errors: ErrorEncoder = error_message,
    ) -> None:
        self._send = send
        self._send_texts = texts_sender(scope, send)
        self._errors = errors
        self._options = options
        self._limits = limits
        self._queue: list[bytes] = []
        self._subscriptions: dict[str, _Subscription] = {}
        self._paused = False  # the queue is full: every subscription is paused
        self._turn = 0  # which subscription resumes first next time
        self._loop = asyncio.get_running_loop()
        self._flush_due = False  # a flush is scheduled (or running): the queue goes out
        # A send that had to wait for the socket (the sender task finishes it); while it
        # waits, nothing else is sent.
        self._waiting_send: Rest | None = None
        self._sender_wake = asyncio.Event()  # set when there is a waiting send
        self._failure: Exception | None = None  # a send's unexpected error, raised by serve
        # The queue has room: cleared at its bound (with every subscription paused), set
        # again once drained to the resume mark (with the subscriptions).
        self._room = asyncio.Event()
        self._room.set()
        self._ended = asyncio.Event()
        self._closed = False  # ended: nothing more is queued or sent (_ended, as a flag)
        self._close_code: int | None = None  # the close the server sends, if any

    @property
    def num_streams(self) -> int:
        return len(self._subscriptions)

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    def is_subscribed(self, stream_id: str) -> bool:
        return stream_id in self._subscriptions

    # ------------------------------------------------------------------ what the gateway calls

    def send_message(self, message: bytes) -> None:
        """Queue one message of :mod:`~sluice.transports.websocket_protocol` (an answer to
        a client message: the receiver waits for room before reading the next one)."""
        self._enqueue(split_messages(message))

    def subscribe(
        self, reader: Reader, *, resumable: bool, frames: FrameSource | None = None
    ) -> None:
        """Deliver ``reader``'s records to this socket until the stream's end, a send
        timeout or the socket's close, as ``frames`` encodes them (each message ending
        with ``LF``; by default the native protocol's ``event`` messages)."""
        stream_id = reader.stream_id
        if stream_id in self._subscriptions:
            raise RuntimeError(f"already subscribed to {stream_id}")
        source = WebSocketFrames(stream_id) if frames is None else frames
        core = Delivery(reader, source, self._options)

        def finish(clean: bool) -> None:
            self._finished(stream_id, clean)

        shell = CallbackSSE(core, write=self._write, finish=finish)
        self._subscriptions[stream_id] = _Subscription(shell, resumable)
        if self._paused:
            shell.pause_writing()
        shell.start()

    async def serve(self, receive: Receive, handle: MessageHandler) -> None:
        """Run the socket until the client leaves or the server closes it."""
        try:
            async with asyncio.TaskGroup() as group:
                sender = group.create_task(self._send_loop())
                receiver = group.create_task(self._receive_loop(receive, handle))
                await self._ended.wait()
                sender.cancel()
                receiver.cancel()
        finally:
            self._end()  # nothing more is queued or sent
            for subscription in list(self._subscriptions.values()):
                subscription.shell.connection_lost()  # the reader leaves: grace or cancel
            self._subscriptions.clear()
            self._queue.clear()
            if self._waiting_send is not None:  # never finished: stop its wait
                self._waiting_send.close()
                self._waiting_send = None
        if self._failure is not None:
            raise self._failure
        code = self._close_code
        if code is not None:
            # A stuck socket may not take even the close frame: then the handler returns
            # and the server closes the connection.
            with contextlib.suppress(TimeoutError, OSError):
                async with asyncio.timeout(self._limits.close_timeout_s):
                    await self._send({"type": "websocket.close", "code": code})

    # ------------------------------------------------------------------ the subscriptions' side

    def _write(self, body: bytes) -> None:
        if body.find(_END) == len(body) - 1:  # one message: a token, the hot path
            if not body.startswith(_COMMENT):
                self._enqueue([body[:-1]])
            return
        self._enqueue([m for m in split_messages(body) if not m.startswith(_COMMENT)])

    def _enqueue(self, messages: list[bytes]) -> None:
        if not messages or self._closed:
            return
        queue = self._queue
        queue += messages
        if not self._flush_due and self._waiting_send is None:
            self._flush_due = True
            self._loop.call_soon(self._flush)
        if len(queue) >= self._limits.max_queued_messages:
            self._room.clear()
            self._paused = True
            for subscription in list(self._subscriptions.values()):
                shell = subscription.shell
                if not shell.core.paused and not shell.closed:
                    shell.pause_writing()

    def _end(self) -> None:
        self._closed = True
        self._ended.set()

    def _finished(self, stream_id: str, clean: bool) -> None:
        subscription = self._subscriptions.pop(stream_id, None)
        if subscription is None:
            return
        if clean:
            if not subscription.shell.core.reader.done:
                # Ended by the server (a drop, a shutdown) before the stream's end.
                self.send_message(
                    self._errors(
                        "interrupted",
                        "the server ended this subscription before the stream's end: "
                        "subscribe again from the last id received",
                        stream_id,
                    )
                )
            return
        # The send timeout: the socket is stuck. Its reader has left already.
        code = CLOSE_TRY_AGAIN if subscription.resumable else CLOSE_NOT_RESUMABLE
        if self._close_code != CLOSE_NOT_RESUMABLE:
            self._close_code = code
        self._end()

    def _resume(self) -> None:
        """The queue drained: resume the subscriptions, a different one first each time,
        until the queue fills again."""
        self._paused = False
        subscriptions = list(self._subscriptions.values())
        if not subscriptions:
            return
        start = self._turn % len(subscriptions)
        self._turn += 1
        for subscription in subscriptions[start:] + subscriptions[:start]:
            if self._paused:
                return
            if not subscription.shell.closed:
                subscription.shell.resume_writing()

    # ------------------------------------------------------------------ the sends

    def _flush(self) -> None:
        """Send the queue, :data:`_MAX_BATCH` messages a write, for as long as each send
        completes at once; a send that has to wait is left to the sender task. The loop's
        callback, once per pass with messages (and the sender's, after a send waited)."""
        send_texts = self._send_texts
        self._flush_due = True  # what the sends' side effects queue is sent by this loop
        try:
            while self._queue and self._waiting_send is None and not self._closed:
                batch = self._queue
                if len(batch) <= _MAX_BATCH:
                    self._queue = []
                else:
                    self._queue = batch[_MAX_BATCH:]
                    batch = batch[:_MAX_BATCH]
                try:
                    rest = start_eagerly(send_texts(batch))
                except OSError:  # the client is gone (uvicorn's ClientDisconnected)
                    self._end()
                    return
                except Exception as exc:  # not ours to swallow: serve raises it
                    self._failure = exc
                    self._end()
                    return
                if rest is not None:
                    self._waiting_send = rest
                    self._sender_wake.set()
                    return
                if self._paused:
                    self._sent()
        finally:
            self._flush_due = False

    def _sent(self) -> None:
        """A write went out while the queue was full: room again at the resume mark."""
        if len(self._queue) <= self._limits.resume_queued_messages:
            self._room.set()
            self._resume()

    # ------------------------------------------------------------------ the tasks

    async def _send_loop(self) -> None:
        """Finish each send that had to wait, then send what queued meanwhile."""
        while True:
            await self._sender_wake.wait()
            self._sender_wake.clear()
            rest = self._waiting_send
            if rest is None:
                continue
            try:
                await rest
            except OSError:  # the client is gone (uvicorn's ClientDisconnected)
                self._waiting_send = None
                self._end()
                return
            if self._paused:
                self._sent()  # may resume subscriptions: what they queue is sent just below
            self._waiting_send = None
            self._flush()

    async def _receive_loop(self, receive: Receive, handle: MessageHandler) -> None:
        while True:
            message = await receive()
            kind = message["type"]
            if kind == "websocket.disconnect":
                self._end()
                return
            if kind != "websocket.receive":
                continue
            # Answered only once the queue has room: until then this message is held and
            # the server reads no further (uvicorn stops reading a socket whose app has a
            # message waiting), so the client's sending fills its own window.
            await self._room.wait()
            text = message.get("text")
            if text is None:
                self.send_message(
                    self._errors(
                        "invalid_request", "binary messages are refused: send JSON text", None
                    )
                )
                continue
            await handle(self, text)
