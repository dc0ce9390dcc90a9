"""The server's side of the engine process: start it, and drive it like ``AsyncEngine``.

:func:`start_child` spawns ``python -m sluice.engine_process.child FD`` on one end of a
Unix socket pair and waits (bounded) for what it serves. :class:`ProcessEngine` reads the
child's messages on the event loop (an :class:`asyncio.Protocol`), hands each step's
outputs to their streams in one pass, and starts another child when one dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import socket
import subprocess
import sys
from collections.abc import Callable
from types import TracebackType
from typing import Any, Final, TypeVar, cast

from sluice.engine.driver import (
    _END,
    STEP_FAILED_MESSAGE,
    EngineClosedError,
    EngineRequestError,
    EngineStepError,
    RequestStream,
    _Sink,
)
from sluice.engine.engine import Engine, EngineConfig
from sluice.engine.outputs import StepStats
from sluice.engine.sampling_params import SamplingParams
from sluice.engine_process.wire import HEADER, EngineInfo, EngineSpec, frame, recv_message
from sluice.errors import CapacityError

__all__ = [
    "RESTART_BACKOFF_S",
    "RESTART_RETRY_AFTER_S",
    "EngineChild",
    "ProcessEngine",
    "start_child",
]

logger = logging.getLogger("sluice.engine_process")

T = TypeVar("T")

# How long stop() waits for the child to exit once told to, before it is killed.
STOP_TIMEOUT_S: Final = 10.0
# Wait before starting a child again after a start failed (a model that no longer loads).
RESTART_BACKOFF_S: Final = 5.0
# Retry-After of a request refused while a child is being started (sluice-tiny loads in
# about a second, a 135 M model in a few).
RESTART_RETRY_AFTER_S: Final = 5.0
# How long a child started again may take to load the model.
RESTART_TIMEOUT_S: Final = 600.0


class EngineChild:
    """One started child: its process, its end of the socket pair, and what it serves."""

    def __init__(self, process: subprocess.Popen[bytes], sock: socket.socket, info: EngineInfo):
        self.process = process
        self.sock = sock
        self.info = info

    def kill(self) -> None:
        """Close the socket (the child exits at its end of file) and make sure it did."""
        _stop(self.process, self.sock)


def _stop(process: subprocess.Popen[bytes], sock: socket.socket) -> None:
    sock.close()
    try:
        process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def start_child(spec: EngineSpec, timeout_s: float) -> EngineChild:
    """Spawn the child, send it ``spec`` and wait up to ``timeout_s`` for it to serve;
    :class:`RuntimeError` with the child's reason when it cannot (the model does not
    load, it died, it took too long)."""
    parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        command = [sys.executable, "-m", "sluice.engine_process.child", str(child_sock.fileno())]
        process = subprocess.Popen(command, pass_fds=(child_sock.fileno(),))
    except OSError:
        parent_sock.close()
        raise
    finally:
        child_sock.close()
    try:
        parent_sock.settimeout(timeout_s)
        parent_sock.sendall(frame(spec))
        reply = recv_message(parent_sock)
        parent_sock.settimeout(None)
    except (OSError, EOFError, ValueError) as exc:
        parent_sock.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=1.0)
        if process.poll() is None:
            process.kill()
            process.wait()
            raise RuntimeError(f"the engine process did not start within {timeout_s:g} s") from exc
        raise RuntimeError(f"the engine process exited with {process.returncode}") from exc
    if reply[0] != "ready":
        _stop(process, parent_sock)
        raise RuntimeError(str(reply[1]))
    return EngineChild(process, parent_sock, reply[1])


class _Protocol(asyncio.Protocol):
    """The server's end of the socket: frames in, to :meth:`ProcessEngine._receive`."""

    def __init__(self, owner: ProcessEngine, child: EngineChild) -> None:
        self.owner = owner
        self.child = child
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer
        buffer += data
        start = 0
        while len(buffer) - start >= HEADER.size:
            (size,) = HEADER.unpack_from(buffer, start)
            end = start + HEADER.size + size
            if len(buffer) < end:
                break
            self.owner._receive(pickle.loads(memoryview(buffer)[start + HEADER.size : end]))
            start = end
        del buffer[:start]

    def connection_lost(self, exc: Exception | None) -> None:
        self.owner._lost(self)


class ProcessEngine:
    """An engine in a child process, driven like :class:`~sluice.engine.driver.AsyncEngine`;
    use as ``async with`` (it stops the child on the way out)."""

    def __init__(self, spec: EngineSpec, child: EngineChild) -> None:
        self._spec = spec
        self._child = child
        self.info = child.info
        self._protocol: _Protocol | None = None
        self._sinks: dict[int, _Sink] = {}
        self._replies: dict[int, tuple[asyncio.Future[Any], _Sink | None]] = {}
        self._next_reply = 0
        self._step_observer: Callable[[StepStats], None] | None = None
        self._closing = False
        self._restart: asyncio.Task[None] | None = None
        self._running = asyncio.Event()
        self.num_restarts = 0

    @property
    def config(self) -> EngineConfig:
        return self.info.config

    @property
    def is_running(self) -> bool:
        return self._running.is_set()

    @property
    def num_live(self) -> int:
        """Requests added and not yet ended, those still waiting for the child's answer too."""
        return len(self._sinks) + sum(1 for _, sink in self._replies.values() if sink is not None)

    @property
    def pid(self) -> int:
        """The child's process id (the current one's, after a restart)."""
        return self._child.process.pid

    def set_step_observer(self, observer: Callable[[StepStats], None] | None) -> None:
        """Tell ``observer`` each step's stats, on the event loop, as they arrive."""
        self._step_observer = observer

    async def wait_running(self) -> None:
        """Return once a child serves (at once, unless one is being restarted)."""
        await self._running.wait()

    async def __aenter__(self) -> ProcessEngine:
        await self._attach(self._child)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop the child (its live requests end with :class:`EngineClosedError`)."""
        self._closing = True
        self._running.clear()
        if self._restart is not None:
            self._restart.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._restart
        self._fail_all(lambda: EngineClosedError("the engine stopped"))
        if self._protocol is not None and self._protocol.transport is not None:
            self._protocol.transport.close()
        await asyncio.to_thread(self._child.kill)

    async def _attach(self, child: EngineChild) -> None:
        loop = asyncio.get_running_loop()
        _, protocol = await loop.connect_accepted_socket(
            lambda: _Protocol(self, child), sock=child.sock
        )
        self._child, self.info, self._protocol = child, child.info, protocol
        self._running.set()

    # -- commands ---------------------------------------------------------------------

    def _send(self, message: tuple[object, ...]) -> None:
        protocol = self._protocol
        if self._closing or protocol is None or protocol.transport is None:
            raise EngineClosedError("the engine process is not running")
        if not self._running.is_set():
            raise _restarting()
        protocol.transport.write(frame(message))

    def _ask(self, kind: str, *args: object, sink: _Sink | None = None) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        reply_id, self._next_reply = self._next_reply, self._next_reply + 1
        self._send((kind, reply_id, *args))
        self._replies[reply_id] = (future, sink)
        return future

    async def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams
    ) -> RequestStream:
        """Queue a request on the child's engine; its admission errors are raised here."""
        sink = _Sink()
        request_id: int = await self._ask("add", list(prompt_token_ids), params, sink=sink)
        return RequestStream(request_id, sink)

    async def abort(self, request_id: int) -> bool:
        """Abort a request between steps; False if it was unknown, done, or the child gone."""
        try:
            aborted: bool = await self._ask("abort", request_id)
        except (EngineClosedError, CapacityError):
            return False
        return aborted

    def abort_nowait(self, request_id: int) -> None:
        with contextlib.suppress(EngineClosedError, CapacityError):
            self._send(("abort", None, request_id))

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run ``fn(engine)`` in the child between steps (``fn`` is pickled: a module-level
        function) and return its result."""
        result: T = await self._ask("call", fn)
        return result

    # -- what the child says ------------------------------------------------------------

    def _receive(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "step":
            _, items, stats = message
            observer = self._step_observer
            if observer is not None and stats is not None:
                observer(stats)
            sinks = self._sinks
            for request_id, output in items:
                sink = sinks.get(request_id)
                if sink is None:
                    continue
                if isinstance(output, str):  # the engine failed this request alone
                    del sinks[request_id]
                    sink.queue.put_nowait(EngineRequestError(output))
                    continue
                if output.finished:
                    del sinks[request_id]
                sink.queue.put_nowait(output)
        elif kind == "aborted":
            _, reply_id, request_id, aborted = message
            sink = self._sinks.pop(request_id, None)
            if sink is not None:
                sink.queue.put_nowait(_END)
            if reply_id is not None:
                self._resolve(reply_id, aborted, None)
        elif kind == "reply":
            _, reply_id, ok, value = message
            self._resolve(reply_id, value, None if ok else value)
        elif kind == "step_failed":
            self._fail_all(lambda: EngineStepError(STEP_FAILED_MESSAGE))

    def _resolve(self, reply_id: int, value: object, error: BaseException | None) -> None:
        future, sink = self._replies.pop(reply_id)
        if error is None and sink is not None:
            self._sinks[value] = sink  # type: ignore[index]  # before the request's first step
        if future.done():  # its caller was cancelled: abort what it added
            if error is None and sink is not None:
                self.abort_nowait(value)  # type: ignore[arg-type]
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    def _fail_all(
        self,
        make_error: Callable[[], BaseException],
        make_reply_error: Callable[[], BaseException] | None = None,
    ) -> None:
        """End every live stream with ``make_error()``, and fail every command waiting for
        its answer with ``make_reply_error()`` (default: the same)."""
        for sink in self._sinks.values():
            sink.queue.put_nowait(make_error())
        self._sinks.clear()
        replies, self._replies = self._replies, {}
        for future, _ in replies.values():
            if not future.done():
                future.set_exception((make_reply_error or make_error)())

    def _lost(self, protocol: _Protocol) -> None:
        if protocol is not self._protocol or self._closing:
            return
        self._running.clear()
        code = protocol.child.process.poll()
        how = "is gone" if code is None else f"exited with {code}"
        logger.error("the engine process %s; starting another", how)
        self._fail_all(lambda: EngineClosedError(f"the engine process {how}"), _restarting)
        self._restart = asyncio.get_running_loop().create_task(self._start_again(protocol.child))

    async def _start_again(self, dead: EngineChild) -> None:
        await asyncio.to_thread(dead.kill)
        while True:
            try:
                child = await asyncio.to_thread(self._start_unless_closing)
            except (OSError, RuntimeError):
                logger.exception("starting the engine process again failed")
                await asyncio.sleep(RESTART_BACKOFF_S)
                continue
            if child is None:
                return
            break
        self.num_restarts += 1
        await self._attach(child)
        logger.info("the engine process is back (pid %d)", child.process.pid)

    def _start_unless_closing(self) -> EngineChild | None:
        """Start a child (in a thread); one that a closing engine no longer wants, because
        :meth:`aclose` came while it loaded (and cancelled the wait, not the thread), is
        stopped here, its socket closed."""
        child = start_child(self._spec, RESTART_TIMEOUT_S)
        if self._closing:
            child.kill()
            return None
        return child


def _restarting() -> CapacityError:
    """A request while the child is being started again: a ``503`` with Retry-After."""
    return CapacityError(
        "the engine process is starting again", retry_after_s=RESTART_RETRY_AFTER_S
    )
