"""Drives an :class:`~sluice.engine.engine.Engine` from asyncio: one engine thread, streams out.

The engine is not thread-safe and a step is a blocking forward pass, so :class:`AsyncEngine`
owns ONE dedicated thread that makes every engine call (``add_request``, ``abort``,
``step``). The event loop talks to it through a thread-safe command queue; the thread
drains the queue between steps and sleeps on a blocking ``get`` while the engine is idle,
so nothing polls. Results come back two ways:

- a command's reply is a :class:`concurrent.futures.Future`, awaited on the loop through
  :func:`asyncio.wrap_future` (admission errors reach :meth:`AsyncEngine.add_request`
  before any output);
- the outputs of one step go back in ONE ``loop.call_soon_threadsafe`` call, which puts
  each into its request's :class:`RequestStream` queue.

An abort is a command, so it is processed between steps: the request's KV blocks are free
at the latest when the current step ends. A request that the engine failed alone (an output
with ``error``: its row could not be sampled or detokenized) ends its stream with
:class:`EngineRequestError`; the other streams go on. A step that raises does not stop the
thread: the engine has already aborted the batch's requests, and since its public API does
not say which those were, every live stream is failed with :class:`EngineStepError` (and
its request aborted) while the thread keeps serving new requests.

Error messages are written for clients: an exception's text or ``repr`` never goes into
one. The cause is chained (``__cause__``) and its traceback logged, for the operator.

Bounds: the command queue holds at most one entry per caller coroutine plus aborts, and the
engine bounds admission (``max_waiting``); a stream's queue holds at most ``max_tokens``
outputs plus its end.

Errors::

    RuntimeError
     └── EngineDriverError
          ├── EngineClosedError   the driver is stopped (or stopped under a live stream)
          ├── EngineStepError     ``Engine.step`` raised; the cause is chained
          └── EngineRequestError  the engine failed this request alone (the others go on)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, TypeVar

from sluice.engine.engine import Engine, EngineConfig, RequestOutput, StepStats
from sluice.engine.sampling_params import SamplingParams

__all__ = [
    "DEFAULT_JOIN_TIMEOUT_S",
    "STEP_FAILED_MESSAGE",
    "AsyncEngine",
    "EngineClosedError",
    "EngineDriverError",
    "EngineRequestError",
    "EngineStepError",
    "RequestStream",
]

logger = logging.getLogger(__name__)

# How long stopping waits for the engine thread to finish its current step and exit.
DEFAULT_JOIN_TIMEOUT_S = 10.0
# A failed step's message, for every request it failed; the cause goes to the log only.
STEP_FAILED_MESSAGE = "the engine step failed; see the server log"

T = TypeVar("T")


class EngineDriverError(RuntimeError):
    """Base of the driver's errors."""


class EngineClosedError(EngineDriverError):
    """The driver is not running, or stopped while the request was live."""


class EngineStepError(EngineDriverError):
    """``Engine.step`` raised while the request was live; the cause is chained."""


class EngineRequestError(EngineDriverError):
    """The engine failed this request alone (its output's ``error``); the traceback is in
    the server log. Retrying the same request would most likely fail the same way."""


class _End:
    """Marks the end of a stream that did not finish by itself (an abort)."""


_END = _End()

_Item = RequestOutput | _End | BaseException


class _Sink:
    """The loop side of one request: its queue. Only the event loop touches it."""

    __slots__ = ("queue",)

    def __init__(self) -> None:
        self.queue: asyncio.Queue[_Item] = asyncio.Queue()


@dataclass(frozen=True, slots=True)
class _Add:
    prompt_token_ids: list[int]
    params: SamplingParams
    sink: _Sink
    reply: concurrent.futures.Future[int]


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: int
    reply: concurrent.futures.Future[bool] | None


@dataclass(frozen=True, slots=True)
class _Call(Generic[T]):
    fn: Callable[[Engine], T]
    reply: concurrent.futures.Future[T]


class _Stop:
    """Abort everything and leave the thread."""


_Command = _Add | _Abort | _Call[Any] | _Stop


class RequestStream:
    """The outputs of one request, in order; iteration ends after the finished output.

    It also ends (without a finished output) when the request is aborted, and raises
    :class:`EngineStepError` or :class:`EngineClosedError` when the engine fails or stops
    under it.
    """

    __slots__ = ("_done", "_held", "_sink", "request_id")

    def __init__(self, request_id: int, sink: _Sink) -> None:
        self.request_id = request_id
        self._sink = sink
        self._done = False
        self._held: _Item | None = None  # taken by take_ready(), not an output

    def __aiter__(self) -> RequestStream:
        return self

    def renamed(self, request_id: int) -> RequestStream:
        """The same outputs under another id (a driver of several engines makes its ids
        unique across them); only before iteration."""
        return RequestStream(request_id, self._sink)

    def take_ready(self) -> list[RequestOutput]:
        """The outputs already here, without waiting: up to the finished one, and none past
        an end or an error (those are left for the next ``__anext__`` to end or raise). A
        consumer slower than the engine's steps sends what piled up in one go."""
        ready: list[RequestOutput] = []
        queue = self._sink.queue
        while not self._done and self._held is None and not queue.empty():
            item = queue.get_nowait()
            if not isinstance(item, RequestOutput):
                self._held = item
                break
            self._done = item.finished
            ready.append(item)
        return ready

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item, self._held = self._held, None
        if item is None:
            item = await self._sink.queue.get()
        if isinstance(item, RequestOutput):
            self._done = item.finished
            return item
        self._done = True
        if isinstance(item, BaseException):
            raise item
        raise StopAsyncIteration


class AsyncEngine:
    """Runs an engine's steps on one dedicated thread; use as ``async with``.

    Only the thread touches ``engine`` from :meth:`__aenter__` to the end of
    :meth:`__aexit__`; read it through :meth:`call`.
    """

    def __init__(self, engine: Engine, *, join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S) -> None:
        if join_timeout_s <= 0:
            raise ValueError(f"join_timeout_s must be positive, got {join_timeout_s}")
        self._engine = engine
        self._join_timeout_s = join_timeout_s
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _accepting against the thread's final drain
        self._accepting = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._exited: concurrent.futures.Future[None] | None = None
        # Engine-thread state: the live requests' sinks.
        self._sinks: dict[int, _Sink] = {}
        self._step_observer: Callable[[StepStats], None] | None = None

    def set_step_observer(self, observer: Callable[[StepStats], None] | None) -> None:
        """Tell ``observer`` each completed step's :class:`~sluice.engine.engine.StepStats`.

        It is called ON THE ENGINE THREAD right after the step, so it must be quick and
        thread-safe (the admission predictor fits its step-cost model there)."""
        self._step_observer = observer

    # -- lifecycle (event loop) -----------------------------------------------------------

    async def __aenter__(self) -> AsyncEngine:
        if self._thread is not None:
            raise RuntimeError("AsyncEngine can be started only once")
        self._loop = asyncio.get_running_loop()
        self._exited = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, name="sluice-engine", daemon=True)
        with self._lock:
            self._accepting = True
        self._thread.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Abort every request, end their streams, and join the thread (with a deadline)."""
        thread, exited = self._thread, self._exited
        if thread is None or exited is None:
            return
        self._submit(_Stop(), closed_ok=True)
        try:
            async with asyncio.timeout(self._join_timeout_s):
                await asyncio.shield(asyncio.wrap_future(exited))
        except TimeoutError:
            logger.warning(
                "engine thread did not stop within %.1f s; leaving it (daemon)",
                self._join_timeout_s,
            )
            return
        thread.join(timeout=self._join_timeout_s)  # it has left its loop: this is at once

    @property
    def config(self) -> EngineConfig:
        """The engine's limits (frozen: safe to read from the loop)."""
        return self._engine.config

    @property
    def is_running(self) -> bool:
        with self._lock:
            return self._accepting

    # -- commands (event loop) ------------------------------------------------------------

    async def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams
    ) -> RequestStream:
        """Queue a request on the engine; admission errors (the scheduler's
        ``QueueFullError``, ``ValueError``) are raised here, before any output."""
        sink = _Sink()
        reply: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._submit(_Add(list(prompt_token_ids), params, sink, reply))
        try:
            request_id = await asyncio.wrap_future(reply)
        except asyncio.CancelledError:
            # The thread may add the request anyway (or already has): abort it then.
            reply.add_done_callback(self._abort_added)
            raise
        return RequestStream(request_id, sink)

    def _abort_added(self, reply: concurrent.futures.Future[int]) -> None:
        if not reply.cancelled() and reply.exception() is None:
            self.abort_nowait(reply.result())

    async def abort(self, request_id: int) -> bool:
        """Abort a request between steps; False if it was unknown, done, or the driver stopped."""
        reply: concurrent.futures.Future[bool] = concurrent.futures.Future()
        if not self._submit(_Abort(request_id, reply), closed_ok=True):
            return False
        return await asyncio.wrap_future(reply)

    def abort_nowait(self, request_id: int) -> None:
        """Ask for an abort without waiting for it (safe from any thread, in any state)."""
        self._submit(_Abort(request_id, None), closed_ok=True)

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps and return its result."""
        reply: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._submit(_Call(fn, reply))
        return await asyncio.wrap_future(reply)

    def _submit(self, command: _Command, *, closed_ok: bool = False) -> bool:
        with self._lock:
            if self._accepting:
                self._commands.put(command)
                return True
        if closed_ok:
            return False
        raise EngineClosedError("the engine driver is not running")

    # -- the engine thread ----------------------------------------------------------------

    def _run(self) -> None:
        engine = self._engine
        try:
            while True:
                # Sleep on the queue while idle; between steps, take what is there.
                command = None if engine.has_unfinished_requests() else self._commands.get()
                stop = command is not None and self._handle(command)
                while not stop:
                    try:
                        command = self._commands.get_nowait()
                    except queue.Empty:
                        break
                    stop = self._handle(command)
                if stop:
                    break
                if engine.has_unfinished_requests():
                    self._step()
        except BaseException as exc:  # a bug in the driver: fail loudly, not silently
            logger.exception("engine thread failed")
            self._shutdown(_chained(EngineDriverError("the engine thread failed"), exc))
            raise
        else:
            self._shutdown(None)
        finally:
            if self._exited is not None:  # always: it is set before the thread starts
                self._exited.set_result(None)

    def _handle(self, command: _Command) -> bool:
        """Run one command on the engine; True for a stop."""
        engine = self._engine
        if isinstance(command, _Stop):
            return True
        if isinstance(command, _Add):
            if not command.reply.set_running_or_notify_cancel():
                return False
            try:
                request_id = engine.add_request(command.prompt_token_ids, command.params)
            except Exception as exc:
                command.reply.set_exception(exc)
            else:
                self._sinks[request_id] = command.sink
                command.reply.set_result(request_id)
        elif isinstance(command, _Abort):
            aborted = engine.abort(command.request_id)
            sink = self._sinks.pop(command.request_id, None)
            if sink is not None:
                self._deliver([(sink, _END)])
            if command.reply is not None and command.reply.set_running_or_notify_cancel():
                command.reply.set_result(aborted)
        else:
            if not command.reply.set_running_or_notify_cancel():
                return False
            try:
                result = command.fn(engine)
            except Exception as exc:
                command.reply.set_exception(exc)
            else:
                command.reply.set_result(result)
        return False

    def _step(self) -> None:
        try:
            outputs = self._engine.step()
        except Exception as exc:
            logger.exception("engine step failed; failing every live request")
            self._fail_all(_step_error_factory(exc))
            return
        observer, stats = self._step_observer, self._engine.last_step
        if observer is not None and stats is not None:
            observer(stats)
        items: list[tuple[_Sink, _Item]] = []
        for output in outputs:
            sink = self._sinks.get(output.request_id)
            if sink is None:
                continue
            if output.finished:
                del self._sinks[output.request_id]
            if output.error is not None:  # the engine has aborted it, and logged why
                items.append((sink, EngineRequestError(output.error)))
            else:
                items.append((sink, output))
        if items:
            self._deliver(items)

    def _fail_all(self, make_error: Callable[[], BaseException]) -> None:
        """Abort every live request and end its stream with a fresh error."""
        items: list[tuple[_Sink, _Item]] = []
        for request_id, sink in self._sinks.items():
            self._engine.abort(request_id)
            items.append((sink, make_error()))
        self._sinks.clear()
        if items:
            self._deliver(items)

    def _shutdown(self, error: BaseException | None) -> None:
        """Stop accepting commands, answer those left, and end every live stream."""
        with self._lock:
            self._accepting = False
        closed = error or EngineClosedError("the engine driver stopped")
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Stop):
                continue
            if isinstance(command, _Abort):
                if command.reply is not None and command.reply.set_running_or_notify_cancel():
                    command.reply.set_result(False)
            elif command.reply.set_running_or_notify_cancel():
                command.reply.set_exception(_chained(EngineClosedError(str(closed)), error))
        try:
            self._fail_all(lambda: _chained(EngineClosedError(str(closed)), error))
        except Exception:  # the engine itself is broken: still end the streams
            logger.exception("aborting requests at shutdown failed")
            items: list[tuple[_Sink, _Item]] = [
                (sink, EngineClosedError(str(closed))) for sink in self._sinks.values()
            ]
            self._sinks.clear()
            self._deliver(items)

    def _deliver(self, items: list[tuple[_Sink, _Item]]) -> None:
        """Hand items to their streams on the event loop, in one loop callback."""
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the loop is closed: nobody is left to read
            logger.debug("event loop closed; dropped %d stream items", len(items))


def _put_all(items: list[tuple[_Sink, _Item]]) -> None:
    for sink, item in items:
        sink.queue.put_nowait(item)


def _step_error_factory(cause: BaseException) -> Callable[[], BaseException]:
    return lambda: _chained(EngineStepError(STEP_FAILED_MESSAGE), cause)


def _chained(error: BaseException, cause: BaseException | None) -> BaseException:
    error.__cause__ = cause
    return error
