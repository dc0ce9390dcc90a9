"""A deliberately small HTTP/1.1 client on a raw socket, for byte-level SSE tests.

It sends one GET, parses the response head, and yields the de-chunked body as it arrives,
so a test can see exactly which bytes came when, and cut the connection at any byte.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["RawResponse", "open_get"]

_READ_TIMEOUT_S = 10.0


@dataclass
class RawResponse:
    sock: socket.socket
    status: int
    headers: list[tuple[str, str]]
    raw_head: bytes
    _buffer: bytes = field(default=b"", repr=False)

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key == name.lower():
                return value
        return None

    def _fill(self) -> bool:
        chunk = self.sock.recv(65536)
        if not chunk:
            return False
        self._buffer += chunk
        return True

    def _read_line(self) -> bytes:
        while b"\r\n" not in self._buffer:
            if not self._fill():
                raise ConnectionError("connection closed inside a chunk header")
        line, _, self._buffer = self._buffer.partition(b"\r\n")
        return line

    def body(self) -> Iterator[bytes]:
        """The de-chunked body, piece by piece as it arrives, until the last chunk."""
        while True:
            size = int(self._read_line().split(b";")[0], 16)
            if size == 0:
                self._read_line()
                return
            while len(self._buffer) < size + 2:
                if not self._fill():
                    raise ConnectionError("connection closed inside a chunk")
            yield self._buffer[:size]
            self._buffer = self._buffer[size + 2 :]

    def sized_body(self) -> bytes:
        """The body of a response with a Content-Length."""
        length = int(self.header("content-length") or 0)
        while len(self._buffer) < length:
            if not self._fill():
                raise ConnectionError("connection closed inside the body")
        body, self._buffer = self._buffer[:length], self._buffer[length:]
        return body

    def next_get(self, target: str, headers: dict[str, str] | None = None) -> RawResponse:
        """Send another GET on the same (kept-alive) connection."""
        port = self.sock.getpeername()[1]
        return _request(self.sock, port, target, headers, self._buffer)

    def close(self) -> None:
        self.sock.close()


def open_get(
    port: int,
    target: str,
    headers: dict[str, str] | None = None,
    *,
    receive_buffer_bytes: int | None = None,
) -> RawResponse:
    """Send ``GET target`` to 127.0.0.1:port and read the response head.

    ``receive_buffer_bytes`` shrinks the socket's receive buffer (set before connecting,
    so the TCP window stays small): a client that stops reading then stalls the server.
    """
    sock = socket.socket()
    sock.settimeout(_READ_TIMEOUT_S)
    if receive_buffer_bytes is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer_bytes)
    sock.connect(("127.0.0.1", port))
    return _request(sock, port, target, headers, b"")


def _request(
    sock: socket.socket, port: int, target: str, headers: dict[str, str] | None, buffer: bytes
) -> RawResponse:
    lines = [f"GET {target} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Accept: text/event-stream"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    while b"\r\n\r\n" not in buffer:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("connection closed before the response head")
        buffer += chunk
    head, _, rest = buffer.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    parsed = []
    for line in header_lines:
        key, _, value = line.partition(":")
        parsed.append((key.strip().lower(), value.strip()))
    response = RawResponse(sock, int(status_line.split()[1]), parsed, head)
    response._buffer = rest
    return response
