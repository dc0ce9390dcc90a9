"""Fixtures for the stream tests: every event-log implementation, and a running hub."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest

from sluice.backends.words import WordsBackend
from sluice.streams import EventLog, HubSettings, LogLimits, MemoryEventLog, StreamHub

LogFactory = Callable[[LogLimits], EventLog]

# Each EventLog implementation joins this list; the contract tests run against all of them.
LOG_FACTORIES: dict[str, LogFactory] = {"memory": MemoryEventLog}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(params=sorted(LOG_FACTORIES))
def make_log(request: pytest.FixtureRequest) -> LogFactory:
    factory: LogFactory = LOG_FACTORIES[request.param]
    return factory


@pytest.fixture
async def hub() -> AsyncIterator[StreamHub]:
    settings = HubSettings(default_grace_s=0.5, retention_s=30.0, max_streams=50)
    hub = StreamHub(MemoryEventLog(), {"words": WordsBackend()}, settings)
    async with hub.running():
        yield hub
