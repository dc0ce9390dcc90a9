"""The floor of the engine-shaped fan-out: what CPython and uvloop do with no server at all.

A raw :class:`asyncio.Protocol` on uvloop answers ``GET /engine?count=K`` with SSE headers
(read-until-close, no chunking) and then ONE ``transport.write`` of one pre-framed
``data: <emit_ns> <seq> <due_ns> \\n\\n`` event per token, each token given to every live
stream by ONE :class:`step_clock.StepClock` every 20 ms (the module the Sluice side and
the sse-starlette baseline use). No framework, no event log, no ids, no JSON, no parsing
beyond finding the end of the request head: per token, a format, an encode and a write.
Anything else a server does (ids for resume, a log that a reconnect replays, a dialect's
framing, heartbeats, slow-client isolation) costs more than this, so this server's
step-to-client latency is a lower bound for any Python server on the same machine
(``fanout_floor.py`` measures it beside ours). ``/`` answers ``ok`` for health checks.

    .venv/bin/python bench/floor_server.py --port 18082
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from typing import cast
from urllib.parse import parse_qs, urlsplit

import uvloop

from step_clock import StepClock, token_text

__all__ = ["FloorProtocol", "main"]

_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
    b"Cache-Control: no-cache\r\nX-Accel-Buffering: no\r\nConnection: close\r\n\r\n"
)
_OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
_MAX_HEAD_BYTES = 8192


class _Feed:
    """One stream: the clock's step writes its next token to the socket."""

    __slots__ = ("count", "seq", "transport")

    def __init__(self, transport: asyncio.Transport, count: int) -> None:
        self.transport = transport
        self.count = count
        self.seq = 0

    def step(self, due_ns: int) -> bool:
        if self.transport.is_closing():
            return False
        self.seq += 1
        self.transport.write(f"data: {token_text(self.seq, due_ns)}\n\n".encode())
        if self.seq == self.count:
            self.transport.close()
            return False
        return True


class FloorProtocol(asyncio.Protocol):
    """One connection: one request, then the stream (or ``ok``), then close."""

    def __init__(self, clock: StepClock) -> None:
        self._clock = clock
        self._head = b""
        self._transport: asyncio.Transport | None = None
        self._feed: _Feed | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        transport = self._transport
        if transport is None or self._feed is not None:
            return
        self._head += data
        if b"\r\n\r\n" not in self._head:
            if len(self._head) > _MAX_HEAD_BYTES:
                transport.close()
            return
        target = self._head.split(b" ", 2)[1].decode("latin-1")
        url = urlsplit(target)
        if url.path != "/engine":
            transport.write(_OK)
            transport.close()
            return
        count = int(parse_qs(url.query).get("count", ["0"])[0] or 0)
        transport.write(_HEAD)
        self._feed = _Feed(transport, count)
        self._clock.join(self._feed)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._feed is not None:
            self._clock.leave(self._feed)


async def _serve(host: str, port: int) -> None:
    clock = StepClock()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = await loop.create_server(lambda: FloorProtocol(clock), host, port, backlog=4096)
    async with server:
        await stop.wait()
    with contextlib.suppress(asyncio.CancelledError):
        await clock.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    uvloop.run(_serve(args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
