"""Throughput of streams a client creates itself: ``POST /v1/streams``, then ``events_url``.

ssebench's throughput test reads one URL with K clients. Ours cannot carry a 1,000-word
prompt in a ``GET /v1/demo/words?text=`` URL (over the server's 8 KiB request-target
limit: 414), so each of our clients does what a real one does: it creates its stream with
``POST /v1/streams`` (a JSON body) and reads the ``events_url`` of the answer, on the same
keep-alive connection, with ssebench's own SSE client protocol (``SSEStream``). Both
requests are inside the measured window: the server's CPU for the creation counts, so our
server pays for one more request per stream than the baseline, which answers one GET.

:func:`run_created_throughput` returns the same keys as ssebench's ``run_throughput``;
the server-side figures come from the same ``ServerProbe``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from types import ModuleType
from typing import Any

__all__ = ["CREATE_PATH", "run_created_throughput"]

CREATE_PATH = "/v1/streams"
# The creation's answer is a small JSON object; a longer head or body is a broken server.
_MAX_ANSWER_BYTES = 64 * 1024


class CreateError(Exception):
    """The creation request failed; the message is the error label ssebench reports."""


async def _create(sock: socket.socket, host: str, port: int, body: bytes) -> str:
    """POST ``body`` to ``/v1/streams`` on ``sock``; the ``events_url`` of a 201."""
    loop = asyncio.get_running_loop()
    head = (
        f"POST {CREATE_PATH} HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "User-Agent: ssebench\r\n\r\n"
    ).encode()
    await loop.sock_sendall(sock, head + body)
    data = b""
    while (end := data.find(b"\r\n\r\n")) < 0 or len(data) < end + 4 + _length(data[:end]):
        chunk = await loop.sock_recv(sock, 65536)
        if not chunk:
            raise CreateError("create-closed")
        data += chunk
        if len(data) > _MAX_ANSWER_BYTES:
            raise CreateError("create-answer-too-long")
    status = int(data.split(None, 2)[1])
    if status != 201:
        raise CreateError(f"create-http-{status}")
    events_url: str = json.loads(data[end + 4 : end + 4 + _length(data[:end])])["events_url"]
    return events_url


def _length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    raise CreateError("create-no-content-length")


async def open_created_stream(
    sb: ModuleType, host: str, port: int, body: bytes, limit_s: float, **kw: Any
) -> Any:
    """ssebench's ``open_stream`` with a ``POST /v1/streams`` before the GET of its
    ``events_url``, on the same connection. Never raises for network or HTTP errors: the
    stream's ``error`` says what went wrong. ``limit_s`` bounds the whole exchange up to the
    GET's response head."""
    loop = asyncio.get_running_loop()
    t0 = time.monotonic_ns()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, sb.LINGER_RST)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        async with asyncio.timeout(limit_s):
            await loop.sock_connect(sock, (host, port))
            events_url = await _create(sock, host, port, body)
        _, proto = await loop.create_connection(lambda: sb.SSEStream(t0, **kw), sock=sock)
    except (OSError, TimeoutError, CreateError, ValueError, IndexError, KeyError) as exc:
        sock.close()
        failed = sb.SSEStream(t0, **kw)
        failed.closed = True
        failed._fail(_label(exc))  # no transport: records the error, resolves the futures
        return failed
    proto.transport.write(sb.build_request(host, port, events_url))
    left = limit_s - (time.monotonic_ns() - t0) / 1e9
    try:
        await asyncio.wait_for(asyncio.shield(proto.headers_fut), max(left, 0.001))
    except TimeoutError:
        proto.error = proto.error or "headers-timeout"
        proto.close()
    return proto


def _label(exc: BaseException) -> str:
    if isinstance(exc, CreateError):
        return str(exc)
    if isinstance(exc, TimeoutError):
        return "create-timeout"
    if isinstance(exc, OSError):
        return f"connect-{type(exc).__name__}"
    return "create-bad-answer"


async def run_created_throughput(
    sb: ModuleType,
    url: str,
    body: bytes,
    clients: int,
    limit_s: float = 60.0,
    pid: int | None = None,
    connect_concurrency: int = 100,
) -> dict[str, Any]:
    """ssebench's ``run_throughput`` (no publisher) with :func:`open_created_stream`;
    ``limit_s`` bounds the wait for every stream's end after the last one started."""
    host, port, _, _ = sb.parse_url(url)
    probe = sb.ServerProbe(pid)
    client_cpu = sb.ClientCPU()
    probe.refresh()
    cpu0, scpu0 = probe.cpu(), probe.sched_cpu()
    t0 = time.monotonic_ns()
    streams: list[Any] = []
    left = clients

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            streams.append(await open_created_stream(sb, host, port, body, 10.0, expect=0))

    await asyncio.gather(*(worker() for _ in range(max(1, min(connect_concurrency, clients)))))
    pending = [s.done_fut for s in streams if not s.done_fut.done()]
    timed_out = False
    if pending:
        _, not_done = await asyncio.wait(pending, timeout=limit_s)
        timed_out = bool(not_done)
    t_last = max((s.t_last for s in streams), default=0)
    cpu1, scpu1 = probe.cpu(), probe.sched_cpu()
    sb.close_all(streams)
    events = sum(s.events for s in streams)
    elapsed = (t_last - t0) / 1e9 if t_last > t0 else None
    cpu_s = None if cpu0 is None else cpu1 - cpu0
    sched_s = None if scpu0 is None else scpu1 - scpu0
    return {
        "test": "throughput",
        "url": f"POST {url}{CREATE_PATH}, then GET its events_url",
        "clients": clients,
        "ok_clients": sum(1 for s in streams if s.ok),
        "complete_clients": sum(1 for s in streams if s.error is None and s.t_done),
        "events": events,
        "expected_events": None,
        "bytes": sum(s.bytes for s in streams),
        "elapsed_s": round(elapsed, 4) if elapsed else None,
        "events_per_s": round(events / elapsed, 1) if elapsed else None,
        "timed_out": timed_out,
        "errors": sb._err_summary(streams),
        "server_pids": probe.pids,
        "server_cpu_s": None if cpu_s is None else round(cpu_s, 3),
        "server_cpu_s_per_1m_events": (
            round(cpu_s / events * 1e6, 2) if cpu_s is not None and events else None
        ),
        "server_sched_cpu_s_per_1m_events": (
            round(sched_s / events * 1e6, 2) if sched_s is not None and events else None
        ),
        "server_busy": (
            round((sched_s if sched_s is not None else cpu_s) / elapsed, 3)
            if cpu_s is not None and elapsed
            else None
        ),
        "client_cpu_util": round(client_cpu.util(), 3),
    }
