"""The embedded engine in a child process: ``sluice serve --engine-process``.

In one process, the engine thread and the event loop take turns on one GIL: each of a
step's hundreds of torch calls gives it up and must win it back from a loop that renders
SSE. :class:`ProcessEngine` runs the engine in a child process of its own and drives it
from the server's loop with the API of :class:`~sluice.engine.driver.AsyncEngine`
(``add_request``, ``abort``, ``call``, streams of :class:`RequestOutput`), so
:class:`~sluice.backends.engine.EngineBackend` serves it unchanged: the prompt is made,
admitted and predicted in the server, the tokens are sampled and detokenized in the child.

Wire: one Unix socket pair; a message is a 4-byte big-endian length and a pickle (both
ends are this program, started by it). Commands go one way (``add``, ``abort``, ``call``,
``stop``); the child answers each that asks, and sends ONE message per step with every
request's output (and the step's :class:`StepStats`), not one per token, as vLLM's engine
core does. An abort is handled between steps, as in-process: the blocks are free when the
current step ends.

Lifecycle: :func:`start_child` spawns ``python -m sluice.engine_process FD`` and waits
(bounded) for it to load the model and say what it serves (:class:`EngineInfo`). The child
ignores SIGINT and SIGTERM (the server drains first) and exits when its socket reaches
end of file: when the server closes it, or when the server dies, however. When the child
dies under the server, every live stream ends with :class:`EngineClosedError` (the backend
makes it a retryable error), new requests are refused with
:class:`~sluice.errors.CapacityError` (``503`` + ``Retry-After``) until a new child has
loaded the model, and one is started at once (again after :data:`RESTART_BACKOFF_S`
while starts fail).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import queue
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
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
from sluice.engine.speculative import SpeculativeConfig
from sluice.errors import CapacityError

__all__ = [
    "MAX_MESSAGE_BYTES",
    "EngineChild",
    "EngineInfo",
    "EngineSpec",
    "ProcessEngine",
    "start_child",
]

logger = logging.getLogger("sluice.engine_process")

T = TypeVar("T")

# A message is a step's outputs (tens of KB at 64 sequences) or the tokenizer bundle
# (tokenizers of real models are tens of MB).
MAX_MESSAGE_BYTES: Final = 256 << 20
# How long stop() waits for the child to exit once told to, before it is killed.
STOP_TIMEOUT_S: Final = 10.0
# Wait before starting a child again after a start failed (a model that no longer loads).
RESTART_BACKOFF_S: Final = 5.0
# Retry-After of a request refused while a child is being started (sluice-tiny loads in
# about a second, a 135 M model in a few).
RESTART_RETRY_AFTER_S: Final = 5.0
_HEADER: Final = struct.Struct(">I")


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """What the child loads and how it runs it (the options of ``sluice serve``)."""

    model: Path
    name: str | None
    device: str
    dtype: str
    num_blocks: int
    max_num_seqs: int
    engine_threads: int
    speculation: SpeculativeConfig | None = None
    draft_model: Path | None = None


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What a started child serves: the name, where, the engine's limits, the tokenizer
    bundle (:mod:`sluice.vllm_grpc.tokenizer_bundle`) and the weight files."""

    name: str
    placement: str
    config: EngineConfig
    bundle: bytes
    weight_files: tuple[Path, ...]


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


def _frame(message: object) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    parts, needed = [], size
    while needed:
        part = sock.recv(min(needed, 1 << 20))
        if not part:
            raise EOFError("the other end closed the socket")
        parts.append(part)
        needed -= len(part)
    return b"".join(parts)


def _recv_message(sock: socket.socket) -> Any:
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if size > MAX_MESSAGE_BYTES:
        raise ValueError(f"a message of {size} bytes is over {MAX_MESSAGE_BYTES}")
    data = _recv_exact(sock, size)
    try:
        return pickle.loads(data)
    except Exception as exc:  # a message this program did not write
        raise ValueError(f"an unreadable message: {exc}") from exc


def start_child(spec: EngineSpec, timeout_s: float) -> EngineChild:
    """Spawn the child, send it ``spec`` and wait up to ``timeout_s`` for it to serve;
    :class:`RuntimeError` with the child's reason when it cannot (the model does not
    load, it died, it took too long)."""
    parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        command = [sys.executable, "-m", "sluice.engine_process", str(child_sock.fileno())]
        process = subprocess.Popen(command, pass_fds=(child_sock.fileno(),))
    except OSError:
        parent_sock.close()
        raise
    finally:
        child_sock.close()
    try:
        parent_sock.settimeout(timeout_s)
        parent_sock.sendall(_frame(spec))
        reply = _recv_message(parent_sock)
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
        while len(buffer) - start >= _HEADER.size:
            (size,) = _HEADER.unpack_from(buffer, start)
            end = start + _HEADER.size + size
            if len(buffer) < end:
                break
            self.owner._receive(pickle.loads(memoryview(buffer)[start + _HEADER.size : end]))
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
        protocol.transport.write(_frame(message))

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
                child = await asyncio.to_thread(start_child, self._spec, 600.0)
            except (OSError, RuntimeError):
                logger.exception("starting the engine process again failed")
                await asyncio.sleep(RESTART_BACKOFF_S)
                continue
            break
        self.num_restarts += 1
        await self._attach(child)
        logger.info("the engine process is back (pid %d)", child.process.pid)


def _restarting() -> CapacityError:
    """A request while the child is being started again: a ``503`` with Retry-After."""
    return CapacityError(
        "the engine process is starting again", retry_after_s=RESTART_RETRY_AFTER_S
    )


# -- the child --------------------------------------------------------------------------


def _load(spec: EngineSpec) -> tuple[Engine, EngineInfo]:
    import torch

    from sluice.engine.loader import load_checkpoint
    from sluice.engine.placement import machine_placement
    from sluice.vllm_grpc.tokenizer_bundle import ModelFiles, write_bundle

    torch.set_num_threads(spec.engine_threads)
    placement = machine_placement(spec.device, spec.dtype)
    checkpoint = load_checkpoint(spec.model, name=spec.name, placement=placement)
    draft = None
    if spec.draft_model is not None:
        draft = load_checkpoint(spec.draft_model, placement=placement).model
    engine = checkpoint.engine(
        num_blocks=spec.num_blocks,
        max_num_seqs=spec.max_num_seqs,
        speculation=spec.speculation,
        draft_model=draft,
    )
    files = ModelFiles(
        checkpoint.tokenizer, checkpoint.chat_template, checkpoint.bos_token, checkpoint.eos_token
    )
    info = EngineInfo(
        checkpoint.name,
        placement.describe(),
        engine.config,
        write_bundle(files, engine.config.max_model_len),
        checkpoint.weight_files,
    )
    return engine, info


def _read_commands(sock: socket.socket, commands: queue.SimpleQueue[tuple[Any, ...]]) -> None:
    """The child's reader thread: every command into the queue; ``stop`` at end of file."""
    try:
        while True:
            commands.put(_recv_message(sock))
    except (OSError, EOFError, ValueError):
        commands.put(("stop",))


def _serve(engine: Engine, sock: socket.socket) -> None:
    """The child's main thread: commands between steps, one message per step."""
    commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
    live: set[int] = set()  # the requests added and not yet finished or aborted
    threading.Thread(target=_read_commands, args=(sock, commands), daemon=True).start()

    def send(message: tuple[object, ...]) -> None:
        sock.sendall(_frame(message))

    while True:
        command = None if engine.has_unfinished_requests() else commands.get()
        while True:
            if command is not None:
                kind = command[0]
                if kind == "stop":
                    return
                if kind == "add":
                    _, reply_id, prompt, params = command
                    try:
                        request_id = engine.add_request(prompt, params)
                    except Exception as exc:  # admission: QueueFullError, ValueError
                        send(("reply", reply_id, False, exc))
                    else:
                        live.add(request_id)
                        send(("reply", reply_id, True, request_id))
                elif kind == "abort":
                    _, reply_id, request_id = command
                    live.discard(request_id)
                    send(("aborted", reply_id, request_id, engine.abort(request_id)))
                elif kind == "call":
                    _, reply_id, fn = command
                    try:
                        send(("reply", reply_id, True, fn(engine)))
                    except Exception as exc:
                        send(("reply", reply_id, False, exc))
            try:
                command = commands.get_nowait()
            except queue.Empty:
                break
        if not engine.has_unfinished_requests():
            continue
        try:
            outputs = engine.step()
        except Exception:
            logger.exception("engine step failed; failing every live request")
            for request_id in live:  # the engine aborted the batch's; these too
                engine.abort(request_id)
            live.clear()
            send(("step_failed",))
            continue
        items = [(o.request_id, o if o.error is None else o.error) for o in outputs]
        live.difference_update(o.request_id for o in outputs if o.finished)
        send(("step", items, engine.last_step))


def _child_main(fd: int) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server drains first, then closes
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sock = socket.socket(fileno=fd)
    try:
        spec = _recv_message(sock)
        engine, info = _load(spec)
    except Exception as exc:
        with contextlib.suppress(OSError):
            sock.sendall(_frame(("failed", f"{type(exc).__name__}: {exc}")))
        return 2
    sock.sendall(_frame(("ready", info)))
    with contextlib.suppress(OSError):
        _serve(engine, sock)
    return 0


if __name__ == "__main__":  # pragma: no cover - run as the child
    # Through the module's own name, so that what it pickles names sluice.engine_process.
    from sluice.engine_process import _child_main as child_main

    code = child_main(int(sys.argv[1]))
    sys.stdout.flush()
    os._exit(code)  # no interpreter teardown (seconds with torch loaded)
