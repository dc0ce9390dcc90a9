"""The composition root: a runtime runs streams with no front at all, every front built on
it reads the same hub, and its lifetime orders resources, hub and backends."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import httpx
import pytest

from sluice.backends.base import GenerationRequest
from sluice.backends.words import WordsBackend
from sluice.errors import CapacityError
from sluice.events import TextDelta
from sluice.gateway.app import SluiceApp
from sluice.gateway.settings import Settings
from sluice.runtime import Runtime
from sluice.streams import HubSettings, LogLimits
from tests.streams.reading import read_until_done

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class ClosingWords(WordsBackend):
    """The words backend, noting when it was closed and what was running then."""

    def __init__(self, order: list[str]) -> None:
        super().__init__()
        self._order = order

    async def aclose(self) -> None:
        self._order.append("backend closed")


def runtime_of(order: list[str]) -> Runtime:
    @contextlib.asynccontextmanager
    async def engine_thread() -> AsyncIterator[object]:
        order.append("resource started")
        yield None
        order.append("resource stopped")

    return Runtime(
        {"words": ClosingWords(order)},
        log_limits=LogLimits(),
        hub_settings=HubSettings(),
        resources=[engine_thread()],
    )


async def test_a_runtime_runs_a_stream_with_no_front() -> None:
    runtime = runtime_of([])
    async with runtime.running():
        stream = await runtime.hub.create("words", GenerationRequest("one two three"))
        events = await read_until_done(runtime.hub.open_reader(stream.id, 0))
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "one two three"


async def test_resources_start_before_the_hub_and_stop_after_the_backends_close() -> None:
    order: list[str] = []
    runtime = runtime_of(order)
    async with runtime.running():
        assert runtime.hub.running_now
        order.append("serving")
    assert order == ["resource started", "serving", "backend closed", "resource stopped"]


async def test_a_stream_started_through_the_app_is_read_from_the_runtime() -> None:
    runtime = runtime_of([])
    app = SluiceApp(Settings(), runtime)
    transport = httpx.ASGITransport(app=app)
    async with (
        runtime.running(),
        httpx.AsyncClient(transport=transport, base_url="http://localhost") as client,
    ):
        created = await client.post("/v1/streams", json={"prompt": "from the app"})
        assert created.status_code == 201, created.text
        events = await read_until_done(runtime.hub.open_reader(created.json()["id"], 0))
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "from the app"


async def test_drain_sets_the_shutdown_event_and_refuses_new_streams() -> None:
    runtime = runtime_of([])
    async with runtime.running():
        assert not runtime.shutdown.is_set()
        await runtime.drain(timeout_s=1.0)
        assert runtime.shutdown.is_set()
        with pytest.raises(CapacityError):
            await runtime.hub.create("words", GenerationRequest("too late"))
