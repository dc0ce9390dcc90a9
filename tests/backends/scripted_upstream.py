"""A scripted OpenAI-compatible upstream: a real HTTP/1.1 server on 127.0.0.1.

A test double of vLLM and friends. Each test sets ``upstream.script``, an async function
that receives the parsed request and a :class:`Reply` and writes whatever the test needs:
a status and headers, SSE chunks one HTTP chunk at a time, pauses on events, a dropped
connection, or nothing at all. Connections are kept alive between requests like a real
server's, so tests can tell a pooled connection from a fresh one, and each connection's
``closed`` event is set the moment the client goes away (read EOF), so tests wait on it
instead of sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DONE",
    "Reply",
    "ScriptedUpstream",
    "ThreadedUpstream",
    "ToolCallingModel",
    "UpstreamConnection",
    "UpstreamRequest",
    "chat_chunk",
    "completion_chunk",
    "sse",
    "usage_chunk",
]

_MAX_HEAD_BYTES = 64 << 10
_STOP_TIMEOUT_S = 5.0

DONE = b"data: [DONE]\n\n"


def sse(payload: object) -> bytes:
    """One SSE event whose data is ``payload`` as JSON (a ``str`` is sent as is)."""
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return b"data: " + data.encode() + b"\n\n"


def completion_chunk(text: str, finish_reason: str | None = None) -> dict[str, Any]:
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "model": "up",
        "choices": [{"index": 0, "text": text, "finish_reason": finish_reason}],
    }


def chat_chunk(
    content: str | None = None,
    *,
    role: str | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
    finish_reason: str | None = None,
) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    if tool_calls is not None:
        delta["tool_calls"] = tool_calls
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "model": "up",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }


def usage_chunk(prompt: int, completion: int, cached: int | None = None) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return {"id": "chatcmpl-1", "choices": [], "usage": usage}


@dataclass(eq=False)
class UpstreamConnection:
    """One accepted TCP connection; ``closed`` is set when either side closes it."""

    number: int
    closed: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class UpstreamRequest:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    connection: UpstreamConnection

    def json(self) -> Any:
        return json.loads(self.body)


class Reply:
    """The script's side of one response."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self.complete = False  # a whole response went out; the connection may be reused

    async def write(self, data: bytes) -> None:
        self._writer.write(data)
        with contextlib.suppress(ConnectionError):
            await self._writer.drain()

    async def head(
        self,
        status: int = 200,
        headers: tuple[tuple[str, str], ...] = (("content-type", "text/event-stream"),),
    ) -> None:
        """A response head for a chunked body."""
        lines = [f"HTTP/1.1 {status} Scripted", "transfer-encoding: chunked"]
        lines += [f"{name}: {value}" for name, value in headers]
        await self.write(("\r\n".join(lines) + "\r\n\r\n").encode())

    async def chunk(self, data: bytes) -> None:
        """One HTTP chunk (one write)."""
        await self.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

    async def end(self) -> None:
        """The chunked terminator."""
        await self.write(b"0\r\n\r\n")
        self.complete = True

    async def stream(self, *chunks: bytes, done: bool = True) -> None:
        """A whole SSE response: head, one HTTP chunk per item, ``[DONE]``, terminator."""
        await self.head()
        for data in chunks:
            await self.chunk(data)
        if done:
            await self.chunk(DONE)
        await self.end()

    async def full(
        self,
        status: int,
        body: bytes,
        content_type: str = "application/json",
        headers: tuple[tuple[str, str], ...] = (),
    ) -> None:
        """A complete response with a Content-Length body."""
        lines = [
            f"HTTP/1.1 {status} Scripted",
            f"content-type: {content_type}",
            f"content-length: {len(body)}",
        ]
        lines += [f"{name}: {value}" for name, value in headers]
        await self.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        self.complete = True

    def drop(self) -> None:
        """Close the connection at once, mid-response."""
        self._writer.transport.abort()


Script = Callable[[UpstreamRequest, Reply], Awaitable[None]]


async def _no_script(request: UpstreamRequest, reply: Reply) -> None:
    await reply.full(500, b'{"error": {"message": "no script set"}}')


class ScriptedUpstream:
    """The server; ``base_url`` ends in ``/v1`` like an OpenAI SDK's."""

    def __init__(self) -> None:
        self.script: Script = _no_script
        self.requests: list[UpstreamRequest] = []
        self.connections: list[UpstreamConnection] = []
        self.errors: list[BaseException] = []
        self.request_seen = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.base_url = ""

    async def start(self) -> ScriptedUpstream:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}/v1"
        return self

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.close()
        async with asyncio.timeout(_STOP_TIMEOUT_S):
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.append(writer)
        connection = UpstreamConnection(len(self.connections))
        self.connections.append(connection)
        buffer = bytearray()  # bytes read from the client but not yet parsed
        try:
            while True:
                request = await self._read_request(reader, buffer, connection)
                if request is None:
                    break
                self.requests.append(request)
                self.request_seen.set()
                reply = Reply(writer)
                async with asyncio.TaskGroup() as group:
                    watcher = group.create_task(self._watch(reader, buffer, connection))
                    await self.script(request, reply)
                    if reply.complete:
                        watcher.cancel()
                if not reply.complete:
                    break
        except Exception as exc:
            self.errors.append(exc)
        finally:
            connection.closed.set()
            writer.close()

    @staticmethod
    async def _watch(
        reader: asyncio.StreamReader, buffer: bytearray, connection: UpstreamConnection
    ) -> None:
        """Set ``connection.closed`` when the client closes; keep what it sends meanwhile."""
        while True:
            try:
                data = await reader.read(65536)
            except ConnectionError:
                data = b""
            if not data:
                connection.closed.set()
                return
            buffer += data  # no await between the read and this: nothing is lost on cancel

    @staticmethod
    async def _read_request(
        reader: asyncio.StreamReader, buffer: bytearray, connection: UpstreamConnection
    ) -> UpstreamRequest | None:
        while (end := buffer.find(b"\r\n\r\n")) < 0:
            if len(buffer) > _MAX_HEAD_BYTES:
                raise AssertionError("request head too large")
            try:
                data = await reader.read(65536)
            except ConnectionError:
                data = b""
            if not data:
                return None
            buffer += data
        head = bytes(buffer[:end]).decode("latin-1")
        del buffer[: end + 4]
        request_line, *header_lines = head.split("\r\n")
        method, path, _ = request_line.split(" ", 2)
        headers: dict[str, str] = {}
        for line in header_lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        while len(buffer) < length:
            data = await reader.read(65536)
            if not data:
                return None
            buffer += data
        body = bytes(buffer[:length])
        del buffer[:length]
        return UpstreamRequest(method, path, headers, body, connection)


class ThreadedUpstream:
    """A :class:`ScriptedUpstream` served by its own event loop in a thread, for tests whose
    client blocks (a sync SDK) while a real ``sluice serve --upstream`` proxies to it.

    Scripts run on the upstream's loop; ``requests`` and ``errors`` are the server's.
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.server = ScriptedUpstream()

    def __enter__(self) -> ThreadedUpstream:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(_STOP_TIMEOUT_S)
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            stopping = asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop)
            stopping.result(2 * _STOP_TIMEOUT_S)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(_STOP_TIMEOUT_S)
            self.loop.close()

    @property
    def base_url(self) -> str:
        return self.server.base_url

    @property
    def requests(self) -> list[UpstreamRequest]:
        return self.server.requests

    @property
    def errors(self) -> list[BaseException]:
        return self.server.errors

    @property
    def script(self) -> Script:
        return self.server.script

    @script.setter
    def script(self, script: Script) -> None:
        self.server.script = script


@dataclass
class ToolCallingModel:
    """A script: an upstream model that calls a tool, as vLLM serving a tool-calling model.

    A request whose messages are exactly ``question`` gets a streamed call of ``tool_name``
    (id ``call_id``, its arguments in ``argument_fragments``), finishing ``tool_calls``; a
    request whose messages are exactly :meth:`history` (the question, the call, ``result``)
    gets ``answer``. Every request must carry exactly ``tools``, and ``expected`` fields
    (``tool_choice``, ``parallel_tool_calls``, ...) with exactly those values; anything else
    is answered 400 naming what differs, as a real server refuses a malformed history.
    """

    tools: list[dict[str, Any]]
    question: list[dict[str, Any]]
    result: str
    answer: str
    tool_name: str = "get_weather"
    call_id: str = "call_1"
    argument_fragments: tuple[str, ...] = ('{"city":', '"Paris"}')
    expected: dict[str, Any] = field(default_factory=dict)

    def call(self) -> dict[str, Any]:
        """The assistant message of the call, as an OpenAI client sends it back."""
        arguments = "".join(self.argument_fragments)
        function = {"name": self.tool_name, "arguments": arguments}
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": self.call_id, "type": "function", "function": function}],
        }

    def history(self) -> list[dict[str, Any]]:
        """The messages of the second turn: the question, the call and its result."""
        tool = {"role": "tool", "tool_call_id": self.call_id, "content": self.result}
        return [*self.question, self.call(), tool]

    async def __call__(self, request: UpstreamRequest, reply: Reply) -> None:
        body = request.json()
        problems = [
            f"{name}: expected {value!r}, got {body.get(name)!r}"
            for name, value in {"tools": self.tools, **self.expected}.items()
            if body.get(name) != value
        ]
        messages = body.get("messages")
        if messages not in (self.question, self.history()):
            problems.append(f"messages: not the question nor its history: {messages!r}")
        if problems:
            error = {"error": {"message": "; ".join(problems), "type": "invalid_request_error"}}
            await reply.full(400, json.dumps(error).encode())
            return
        if messages == self.question:
            first = {"index": 0, "id": self.call_id, "type": "function"}
            first["function"] = {"name": self.tool_name, "arguments": ""}
            fragments = [
                sse(chat_chunk(tool_calls=[{"index": 0, "function": {"arguments": part}}]))
                for part in self.argument_fragments
            ]
            await reply.stream(
                sse(chat_chunk(role="assistant")),
                sse(chat_chunk(tool_calls=[first])),
                *fragments,
                sse(chat_chunk(finish_reason="tool_calls")),
                sse(usage_chunk(20, 9)),
            )
            return
        await reply.stream(
            sse(chat_chunk(self.answer, role="assistant")),
            sse(chat_chunk(finish_reason="stop")),
            sse(usage_chunk(30, 7)),
        )
