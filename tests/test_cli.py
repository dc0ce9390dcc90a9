"""``sluice serve`` plumbing that needs no server process."""

from __future__ import annotations

import asyncio
import os
import socket

import uvloop

from sluice.cli import inherited_listener


def test_an_inherited_tcp_listener_gets_connections_with_nagle_off() -> None:
    """A ``--fd`` socket is TCP to the event loop, so it turns Nagle off per connection
    (else every small SSE write waits ~40 ms for the client's delayed ACK)."""
    with socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))
        bound.listen()
        listener = inherited_listener(os.dup(bound.fileno()))
        assert listener.family == socket.AF_INET

        async def accept_one() -> int:
            accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

            class Probe(asyncio.Protocol):
                def connection_made(self, transport: asyncio.BaseTransport) -> None:
                    sock = transport.get_extra_info("socket")
                    accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                    transport.close()

            server = await asyncio.get_running_loop().create_server(Probe, sock=listener)
            async with server:
                _, writer = await asyncio.open_connection(*bound.getsockname())
                try:
                    return await asyncio.wait_for(accepted, 10)
                finally:
                    writer.close()

        assert uvloop.run(accept_one()) != 0
