"""A deliberately small HTTP/1.1 client on a raw socket, for byte-level SSE tests.

It sends one GET, parses the response head, and yields the de-chunked body as it arrives,
so a test can see exactly which bytes came when, and cut the connection at any byte.
:func:`wait_closed` watches many raw sockets at once until the server closes them.
"""

from __future__ import annotations

import selectors
import socket
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

__all__ = [
    "Closed",
    "RawResponse",
    "open_get",
    "open_post",
    "read_until_closed",
    "split_responses",
    "wait_closed",
]

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
        """The de-chunked body, piece by piece as it arrives, until the last chunk; a body
        with a Content-Length instead (a refusal, an SSE ``retry:`` hint) in one piece."""
        chunked = (self.header("transfer-encoding") or "").lower() == "chunked"
        if not chunked and self.header("content-length"):
            yield self.sized_body()
            return
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
    try:
        sock.connect(("127.0.0.1", port))
        return _request(sock, port, target, headers, b"")
    except BaseException:
        sock.close()  # refused, or closed before the head (a killed server behind a proxy)
        raise


def open_post(port: int, target: str, body: bytes) -> RawResponse:
    """Send ``POST target`` with a JSON ``body`` to 127.0.0.1:port and read the response
    head (a streamed answer is then read with :meth:`RawResponse.body`)."""
    sock = socket.socket()
    sock.settimeout(_READ_TIMEOUT_S)
    sock.connect(("127.0.0.1", port))
    headers = {"Content-Type": "application/json", "Content-Length": str(len(body))}
    return _request(sock, port, target, headers, b"", method="POST", body=body)


def _request(
    sock: socket.socket,
    port: int,
    target: str,
    headers: dict[str, str] | None,
    buffer: bytes,
    *,
    method: str = "GET",
    body: bytes = b"",
) -> RawResponse:
    lines = [f"{method} {target} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Accept: text/event-stream"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
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


@dataclass(frozen=True)
class Closed:
    """What a socket received before the server closed it, and when that was seen."""

    received: bytes
    at: float  # time.monotonic()
    reset: bool  # a reset (RST), not an orderly end (FIN)


def wait_closed(socks: Sequence[socket.socket], timeout_s: float) -> list[Closed | None]:
    """Read every socket until the server closes it, for ``timeout_s`` at most: per socket,
    what it received and when it closed, or ``None`` if still open at the deadline."""
    results: list[Closed | None] = [None] * len(socks)
    received = [b""] * len(socks)
    with selectors.DefaultSelector() as selector:
        for index, sock in enumerate(socks):
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ, index)
        deadline = time.monotonic() + timeout_s
        num_open = len(socks)
        while num_open and (left := deadline - time.monotonic()) > 0:
            for key, _ in selector.select(left):
                index = key.data
                try:
                    chunk = socks[index].recv(65536)
                except BlockingIOError:
                    continue
                except ConnectionResetError:
                    results[index] = Closed(received[index], time.monotonic(), reset=True)
                else:
                    if chunk:
                        received[index] += chunk
                        continue
                    results[index] = Closed(received[index], time.monotonic(), reset=False)
                selector.unregister(socks[index])
                num_open -= 1
    return results


def read_until_closed(sock: socket.socket, timeout_s: float = _READ_TIMEOUT_S) -> Closed:
    """Read one socket until the server closes it; fail if it is still open after
    ``timeout_s``."""
    closed = wait_closed([sock], timeout_s)[0]
    if closed is None:
        raise AssertionError(f"the server did not close the connection within {timeout_s} s")
    return closed


def split_responses(data: bytes) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """The whole responses at the start of ``data`` (head, de-chunked or sized body), in
    order, and what follows the last of them (an unfinished response, or nothing)."""
    responses = []
    while b"\r\n\r\n" in data:
        head, _, rest = data.partition(b"\r\n\r\n")
        fields = head.lower()
        if b"transfer-encoding: chunked" in fields:
            body = b""
            while True:
                size_line, found, after = rest.partition(b"\r\n")
                if not found:
                    return responses, data
                size = int(size_line.split(b";")[0], 16)
                if len(after) < size + 2:
                    return responses, data
                body += after[:size]
                rest = after[size + 2 :]
                if size == 0:
                    break
        else:
            length = 0
            for line in fields.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip() == b"content-length":
                    length = int(value)
            if len(rest) < length:
                return responses, data
            body, rest = rest[:length], rest[length:]
        responses.append((head, body))
        data = rest
    return responses, data
