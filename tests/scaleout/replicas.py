"""Helpers of the scale-out tests: ``sluice serve --redis`` replicas, SSE reads, metrics."""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families

from sluice.sse import Decoder, Event
from tests.rawhttp import open_get
from tests.server import ServerProcess

__all__ = [
    "Read",
    "event_seqs",
    "kill",
    "kv_blocks_used",
    "read_resuming",
    "read_sse",
    "replicas",
    "retrying",
    "text_of",
    "wait_until",
]


@contextlib.contextmanager
def replicas(
    redis_url: str, count: int, *options: str, engine: bool = False
) -> Iterator[list[ServerProcess]]:
    """``count`` replicas on one Redis, started together, each ready; they serve only
    ``words`` unless ``engine`` (then the bundled model too)."""
    if not engine:
        options = ("--no-model", *options)
    servers = [ServerProcess("--redis", redis_url, *options) for _ in range(count)]
    with contextlib.ExitStack() as stack:
        for server in servers:
            stack.enter_context(server)
        for server in servers:
            server.wait_ready()
        yield servers


class Read:
    """One SSE read: the complete events it got, and whether the body ended by itself."""

    def __init__(
        self, events: list[Event], ended: bool, status: int, retry_ms: int | None = None
    ) -> None:
        self.events = events
        self.ended = ended
        self.status = status
        self.retry_ms = retry_ms

    @property
    def last_id(self) -> str | None:
        ids = [event.id for event in self.events if event.id]
        return ids[-1] if ids else None

    @property
    def come_back_later(self) -> bool:
        """Whether this is the server's "come back later" to EventSource: a ``200`` whose
        body, ended by itself, is only a ``retry:`` hint, no event (a full server, or a
        replica that Redis cannot serve another replica's stream for a moment)."""
        return self.status == 200 and self.ended and not self.events and self.retry_ms is not None


def read_sse(
    server: ServerProcess,
    target: str,
    last_id: str | None = None,
    *,
    max_events: int | None = None,
    timeout_s: float = 10.0,
) -> Read:
    """Read ``target`` on ``server`` to its end, or until ``max_events`` events came.

    An answer that is only a ``retry:`` hint (:attr:`Read.come_back_later`) is asked
    again from the same ``Last-Event-ID``, as EventSource does, for ``timeout_s`` at most
    (see :func:`_asked_again`); any other answer is returned for the test to judge."""
    return _asked_again(
        lambda: _read_sse_once(server, target, last_id, max_events),
        lambda read: read.come_back_later,
        f"an SSE read of {target} after {last_id} (only a retry: hint until then)",
        timeout_s,
    )


def _read_sse_once(
    server: ServerProcess, target: str, last_id: str | None, max_events: int | None
) -> Read:
    headers = {"Last-Event-ID": last_id} if last_id else {}
    response = open_get(server.port, target, headers)
    if response.status != 200:
        response.close()
        return Read([], True, response.status)
    decoder = Decoder()
    events: list[Event] = []
    ended = True
    for piece in response.body():  # a stream's chunks, or a retry: hint's whole body
        events.extend(decoder.feed(piece))
        if max_events is not None and len(events) >= max_events:
            ended = False
            break
    if ended:
        events.extend(decoder.close())
    response.close()
    return Read(events, ended, 200, decoder.retry_ms)


def text_of(events: list[Event]) -> str:
    return "".join(orjson.loads(e.data)["text"] for e in events if e.event == "token")


def kv_blocks_used(server: ServerProcess, model: str = "sluice-tiny") -> float:
    text = httpx.get(f"{server.base_url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "sluice_engine_kv_blocks_used" and sample.labels["model"] == model:
                return sample.value
    raise AssertionError("no sluice_engine_kv_blocks_used sample")


def wait_until(
    condition: object, what: str, timeout_s: float = 10.0, *, interval_s: float = 0.02
) -> None:
    """Poll an observable condition (a callable returning truthy) with a deadline."""
    assert callable(condition)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(interval_s)  # polling an observable condition with a deadline
    raise AssertionError(f"never happened: {what}")


# How long a client here waits before asking again after a "come back later" (a 503's
# Retry-After, an SSE read's retry: hint). The server's is a second or more; a test needs
# the retry to happen, not the whole wait.
MAX_RETRY_WAIT_S = 0.25

_Answer = TypeVar("_Answer")


def _asked_again(
    ask: Callable[[], _Answer],
    come_back_later: Callable[[_Answer], bool],
    what: str,
    timeout_s: float,
) -> _Answer:
    """The answer to ``ask()``, asked again as a client does while ``come_back_later`` says
    the server refused it for now, which a replica does for a read of a stream another
    replica runs while Redis cannot serve it (its subscription down for a moment, as on a
    loaded machine). Between tries it waits :data:`MAX_RETRY_WAIT_S` (the server's wait,
    capped), and it asks for ``timeout_s`` at most, then fails naming ``what``."""
    answer: _Answer | None = None

    def answered() -> bool:
        nonlocal answer
        answer = ask()
        return not come_back_later(answer)

    wait_until(answered, what, timeout_s, interval_s=MAX_RETRY_WAIT_S)
    assert answer is not None
    return answer


def retrying(
    request: Callable[[], httpx.Response], what: str, timeout_s: float = 10.0
) -> httpx.Response:
    """The answer to ``request``, asked again (:func:`_asked_again`) while it is a ``503``
    with ``Retry-After``. Any other answer, a ``503`` without ``Retry-After`` included, is
    returned as it is, for the test to judge."""
    return _asked_again(
        request,
        lambda answer: answer.status_code == 503 and "retry-after" in answer.headers,
        f"{what} (503 + Retry-After until then)",
        timeout_s,
    )


_TERMINAL = ("done", "error")


def read_resuming(
    port: int,
    target: str,
    *,
    cut_after_events: Callable[[], int | None] = lambda: None,
    deadline_s: float = 60.0,
    moved: Callable[[], None] | None = None,
) -> list[Event]:
    """Read ``target`` through 127.0.0.1:``port`` to its terminal event as EventSource
    would: whenever a connection ends without it (a gateway killed, a refusal's ``retry:``
    only answer, a cut), reconnect with the last id seen, after 100 ms. Each connection
    is cut after ``cut_after_events()`` events (``None``: never). Returns every event
    received, in order (so a doubled one shows)."""
    events: list[Event] = []
    last_id: str | None = None
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        headers = {"Last-Event-ID": last_id} if last_id else {}
        cut = cut_after_events()
        try:
            response = open_get(port, target, headers)
        except OSError:
            time.sleep(0.1)  # EventSource's reconnection delay, not a synchronisation
            continue
        if response.status == 204:
            response.close()
            return events
        got = 0
        try:
            if response.status == 200:
                decoder = Decoder()
                for piece in response.body():
                    for event in decoder.feed(piece):
                        events.append(event)
                        last_id = event.id or last_id
                        got += 1
                        if event.event in _TERMINAL:
                            return events
                    if cut is not None and got >= cut:
                        break
        except OSError:
            pass  # the gateway went away mid-body: resume
        finally:
            response.close()
        if moved is not None:
            moved()
        time.sleep(0.1)  # EventSource's reconnection delay, not a synchronisation
    raise AssertionError(f"{target}: no terminal event within {deadline_s} s")


def event_seqs(events: list[Event]) -> list[int]:
    return [int(str(e.id).rsplit(":", 1)[1]) for e in events if e.id]


def kill(server: ServerProcess, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to the server (``kill -9`` by default) and close the test's own copy
    of its listening socket, so that once the server is gone its port refuses connections
    (a load balancer then tries the next gateway) instead of queueing them unanswered."""
    assert server.process is not None
    server.process.send_signal(sig)
    if sig == signal.SIGKILL:
        server.process.wait()
    server.sock.close()
