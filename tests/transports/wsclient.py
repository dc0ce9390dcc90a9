"""WebSocket clients for the tests of ``GET /v1/ws``: the ``websockets`` library's sync
client, and a stuck one on a raw socket (it sends, and never reads)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import orjson
from websockets.client import ClientProtocol
from websockets.frames import Opcode
from websockets.protocol import State
from websockets.sync.client import ClientConnection, connect
from websockets.uri import parse_uri

from tests.server import ServerProcess

__all__ = ["StuckSocket", "collect", "open_ws", "receive", "send_json"]

RECEIVE_TIMEOUT_S = 30.0


@contextmanager
def open_ws(server: ServerProcess, query: str = "", **options: Any) -> Iterator[ClientConnection]:
    """A socket to the server's ``/v1/ws`` (no proxy, no compression)."""
    uri = f"ws://127.0.0.1:{server.port}/v1/ws{query}"
    with connect(uri, proxy=None, compression=None, open_timeout=30, **options) as ws:
        yield ws


def send_json(ws: ClientConnection, message: dict[str, object]) -> None:
    ws.send(orjson.dumps(message).decode())


def receive(ws: ClientConnection) -> dict[str, Any]:
    message: dict[str, Any] = orjson.loads(ws.recv(timeout=RECEIVE_TIMEOUT_S))
    return message


def collect(ws: ClientConnection, stream_id: str, count: int | None = None) -> list[dict[str, Any]]:
    """``stream_id``'s event messages until its terminal event (or ``count`` of them);
    any other message fails the test."""
    events: list[dict[str, Any]] = []
    while count is None or len(events) < count:
        message = receive(ws)
        assert message["type"] == "event", message
        assert message["stream_id"] == stream_id, message
        events.append(message)
        if message["event"] in ("done", "error"):
            break
    return events


class StuckSocket:
    """A WebSocket client on a raw socket with a tiny receive window, that sends what it is
    told and reads nothing (until :meth:`drain`)."""

    def __init__(
        self, server: ServerProcess, receive_buffer_bytes: int = 4096, path: str = "/v1/ws"
    ) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer_bytes)
        self.sock.settimeout(RECEIVE_TIMEOUT_S)
        self.sock.connect(("127.0.0.1", server.port))
        self.protocol = ClientProtocol(parse_uri(f"ws://127.0.0.1:{server.port}{path}"))
        self.protocol.send_request(self.protocol.connect())
        self._flush()
        while self.protocol.state is State.CONNECTING:
            self.protocol.receive_data(self.sock.recv(1))  # byte by byte: not a frame more
        assert self.protocol.handshake_exc is None, self.protocol.handshake_exc
        self.protocol.events_received()  # the handshake's response

    def send_json(self, message: dict[str, object]) -> None:
        self.protocol.send_text(orjson.dumps(message))
        self._flush()

    def _flush(self) -> None:
        self.sock.sendall(b"".join(self.protocol.data_to_send()))

    def drain(self, until_terminal: bool = False) -> tuple[list[dict[str, Any]], int | None]:
        """Read until the server closes (or, ``until_terminal``, until a ``done`` or
        ``error`` event): the text messages, and the close code (``None``: none came)."""
        messages: list[dict[str, Any]] = []
        while True:
            try:
                data = self.sock.recv(65536)
            except (ConnectionResetError, TimeoutError):
                data = b""
            if not data:
                self.protocol.receive_eof()
            else:
                self.protocol.receive_data(data)
            for event in self.protocol.events_received():
                if event.opcode is Opcode.TEXT:
                    messages.append(orjson.loads(event.data))
                    if until_terminal and messages[-1].get("event") in ("done", "error"):
                        return messages, None
            if not data or self.protocol.close_rcvd is not None:
                close = self.protocol.close_rcvd
                return messages, None if close is None else close.code

    def close(self) -> None:
        self.sock.close()
