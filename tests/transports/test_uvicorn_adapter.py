"""What the uvicorn adapter relies on, pinned against the installed uvicorn.

:data:`~sluice.transports.http1.uvicorn_adapter.RELIED_ON` lists every uvicorn name the
adapter touches. Each is checked here: the methods exist with the parameters the adapter's
overrides take, the per-connection and per-request attributes exist on a real uvicorn
protocol serving a real request on 127.0.0.1, and the server's signal bookkeeping is
where the drain expects it. A uvicorn release that renames or reshapes any of them fails
these tests loudly, instead of silently breaking streaming, the connection limit or the
drain of ``sluice serve``.
"""

from __future__ import annotations

import asyncio
import inspect
import socket
from typing import Any

import pytest
import uvicorn
import websockets
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.utils import get_client_addr
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from uvicorn.server import ServerState

from sluice.transports.asgi import Receive, Scope, Send
from sluice.transports.http1.uvicorn_adapter import (
    RELIED_ON,
    SluiceHttpProtocol,
    SluiceWebSocketProtocol,
)
from sluice.transports.websocket import SEND_TEXTS

pytestmark = pytest.mark.anyio

# Lists that RELIED_ON must name exactly (a name added to the adapter is pinned here too).
PINNED_KINDS = {
    "HttpToolsProtocol",
    "HttpToolsProtocol instance",
    "RequestResponseCycle instance",
    "FlowControl",
    "ServerState instance",
    "uvicorn.protocols.utils",
    "Server",
    "Server instance",
    "WebSocketsSansIOProtocol",
    "WebSocketsSansIOProtocol instance",
}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def parameters(function: Any) -> list[str]:
    return list(inspect.signature(function).parameters)


def test_every_kind_of_name_the_adapter_relies_on_is_pinned() -> None:
    assert set(RELIED_ON) == PINNED_KINDS


def test_the_protocols_constructor_takes_what_uvicorn_passes() -> None:
    assert parameters(HttpToolsProtocol.__init__) == [
        "self",
        "config",
        "server_state",
        "app_state",
        "_loop",
    ]


@pytest.mark.parametrize("name", RELIED_ON["HttpToolsProtocol"])
def test_each_protocol_method_exists_with_the_parameters_its_override_takes(name: str) -> None:
    base = getattr(HttpToolsProtocol, name, None)
    assert callable(base), f"HttpToolsProtocol.{name} is gone"
    override = SluiceHttpProtocol.__dict__.get(name)
    if override is not None and name != "__init__":
        assert parameters(override) == parameters(base)


@pytest.mark.parametrize("name", RELIED_ON["FlowControl"])
def test_flow_control_has_each_member_the_adapter_uses(name: str) -> None:
    class Transport:
        def pause_reading(self) -> None: ...

        def resume_reading(self) -> None: ...

    flow = FlowControl(Transport())  # type: ignore[arg-type]
    assert hasattr(flow, name)


def test_server_state_and_the_servers_signal_record_are_where_the_adapter_reads_them() -> None:
    state = ServerState()
    for name in RELIED_ON["ServerState instance"]:
        assert hasattr(state, name)
    assert isinstance(state.default_headers, list)

    async def app(scope: Scope, receive: Receive, send: Send) -> None: ...

    server = uvicorn.Server(uvicorn.Config(app, log_config=None))
    for name in RELIED_ON["Server"]:
        assert callable(getattr(uvicorn.Server, name))
    assert parameters(uvicorn.Server.handle_exit) == ["self", "sig", "frame"]
    for name in RELIED_ON["Server instance"]:
        assert isinstance(getattr(server, name), list)


def test_the_client_address_helper_formats_the_scopes_client() -> None:
    assert RELIED_ON["uvicorn.protocols.utils"] == ("get_client_addr",)
    assert get_client_addr({"client": ("127.0.0.1", 5000)}) == "127.0.0.1:5000"  # type: ignore[typeddict-item]


async def test_a_protocol_serving_a_request_has_every_attribute_the_adapter_uses() -> None:
    """A plain uvicorn protocol on a real socket: inside the app, the connection's and the
    request cycle's attributes are there."""
    loop = asyncio.get_running_loop()
    protocols: list[HttpToolsProtocol] = []
    missing: dict[str, list[str]] = {}

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        protocol = protocols[0]
        missing["protocol"] = [
            name for name in RELIED_ON["HttpToolsProtocol instance"] if not hasattr(protocol, name)
        ]
        missing["cycle"] = [
            name
            for name in RELIED_ON["RequestResponseCycle instance"]
            if not hasattr(protocol.cycle, name)
        ]
        missing["flow"] = [n for n in RELIED_ON["FlowControl"] if not hasattr(protocol.flow, n)]
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    config = uvicorn.Config(app, lifespan="off", log_config=None, access_log=False)
    config.load()
    state = ServerState()

    def factory() -> HttpToolsProtocol:
        protocol = HttpToolsProtocol(config, state, {}, _loop=loop)
        protocols.append(protocol)
        return protocol

    server = await loop.create_server(factory, "127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        writer.close()
        await writer.wait_closed()
    finally:
        server.close()
        await server.wait_closed()
    assert head.startswith(b"HTTP/1.1 204 ")
    assert missing == {"protocol": [], "cycle": [], "flow": []}


def test_the_websocket_protocols_override_takes_what_uvicorn_calls() -> None:
    assert RELIED_ON["WebSocketsSansIOProtocol"] == ("handle_connect",)
    assert parameters(WebSocketsSansIOProtocol.handle_connect) == ["self", "event"]
    assert parameters(SluiceWebSocketProtocol.handle_connect) == ["self", "event"]


async def test_a_socket_sends_a_batch_of_texts_as_one_frame_each_in_one_write() -> None:
    """A real uvicorn server with the adapter's WebSocket protocol: the app finds the batch
    sender in its scope and every attribute it reads on the protocol; a `websockets`
    client gets each message of a batch as its own text frame, in order, and a batch
    after the client left raises the OSError uvicorn raises for ``websocket.send``."""
    missing: list[str] = []
    after_close: list[BaseException] = []
    left = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "websocket":
            return
        assert (await receive())["type"] == "websocket.connect"
        await send({"type": "websocket.accept"})
        send_texts = scope["extensions"][SEND_TEXTS]["send"]
        protocol = send_texts.__self__
        instance = RELIED_ON["WebSocketsSansIOProtocol instance"]
        missing.extend(name for name in instance if not hasattr(protocol, name))
        await send_texts(["один".encode(), b'{"n":2}', b"three"])
        await send_texts([b"four"])
        assert (await receive())["type"] == "websocket.disconnect"
        await left.wait()
        try:
            await send_texts([b"too late"])
        except OSError as exc:
            after_close.append(exc)

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()  # connections wait in the backlog until the server accepts them
    port = listener.getsockname()[1]
    config = uvicorn.Config(app, ws=SluiceWebSocketProtocol, lifespan="off", log_config=None)
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve(sockets=[listener]))
    try:
        async with websockets.connect(f"ws://127.0.0.1:{port}/") as client:
            received = [await client.recv() for _ in range(4)]
        left.set()
    finally:
        server.should_exit = True
        await serving
    assert received == ["один", '{"n":2}', "three", "four"]
    assert missing == []
    assert len(after_close) == 1
