"""The hub's limits: live streams per tenant, tokens per stream, and stream duration."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from sluice.backends.base import GenerationRequest
from sluice.backends.words import WordsBackend
from sluice.errors import CapacityError, TenantLimitError
from sluice.events import Finished, FinishReason, NeutralEvent, TextDelta, Usage
from sluice.streams import HubSettings, MemoryEventLog, StreamHub, StreamState
from tests.streams.reading import read_until_done

pytestmark = pytest.mark.anyio


class Recorder:
    """A stream observer that keeps what it is told about limits."""

    def __init__(self) -> None:
        self.limits: list[str] = []

    def started(self, stream: object, queued_s: float) -> None: ...

    def tokens(self, stream: object, count: int, since_s: float, first: bool) -> None: ...

    def finished(self, stream: object, outcome: str, e2e_s: float) -> None: ...

    def refused(self, stream: object, reason: str) -> None: ...

    def send_timed_out(self) -> None: ...

    def coalesced_events(self, count: int) -> None: ...

    def token_write_gap(self, model: str, gap_s: float) -> None: ...

    def limited(self, stream: object, limit: str) -> None:
        self.limits.append(limit)


@pytest.fixture
async def recorder() -> Recorder:
    return Recorder()


@contextlib.asynccontextmanager
async def running_hub(settings: HubSettings, recorder: Recorder) -> AsyncIterator[StreamHub]:
    hub = StreamHub(MemoryEventLog(), {"words": WordsBackend()}, settings, recorder)  # type: ignore[arg-type]
    async with hub.running():
        yield hub


def texts(events: list[NeutralEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


def words(n: int) -> str:
    return " ".join(f"w{i}" for i in range(n))


async def test_tenant_over_its_live_streams_is_refused_with_a_tenant_limit(
    recorder: Recorder,
) -> None:
    settings = HubSettings(max_streams_per_tenant=2, retry_after_s=2.0)
    async with running_hub(settings, recorder) as hub:
        slow = GenerationRequest(prompt=words(50), interval_s=0.05)
        first = await hub.create("words", slow, tenant="a")
        await hub.create("words", slow, tenant="a")
        with pytest.raises(TenantLimitError) as refused:
            await hub.create("words", slow, tenant="a")
        assert isinstance(refused.value, CapacityError)  # a 429 is still a capacity refusal
        assert refused.value.retry_after_s == 2.0
        assert refused.value.tenant == "a"
        await hub.create("words", slow, tenant="b")  # other tenants are not affected
        assert hub.num_live("a") == 2
        hub.cancel(first.id)
        await read_until_done(hub.open_reader(first.id, 0))
        assert hub.num_live("a") == 1
        await hub.create("words", slow, tenant="a")  # the ended stream's place is free again


async def test_requested_max_tokens_above_the_limit_is_clamped(recorder: Recorder) -> None:
    async with running_hub(HubSettings(max_tokens_per_stream=5), recorder) as hub:
        stream = await hub.create("words", GenerationRequest(prompt=words(20), max_tokens=50))
        events = await read_until_done(hub.open_reader(stream.id, 0))
        assert texts(events) == "w0 w1 w2 w3 w4"
        assert events[-1] == Finished(FinishReason.LENGTH)


async def test_backend_producing_past_the_limit_is_stopped_with_length(
    recorder: Recorder,
) -> None:
    """No max_tokens in the request: the backend's own limit is larger, the hub's applies."""
    async with running_hub(HubSettings(max_tokens_per_stream=7), recorder) as hub:
        stream = await hub.create("words", GenerationRequest(prompt=words(30)))
        events = await read_until_done(hub.open_reader(stream.id, 0))
        assert texts(events) == words(7)
        assert isinstance(events[-2], Usage)
        assert events[-1] == Finished(FinishReason.LENGTH)
        assert stream.num_tokens == 7
        assert stream.state is StreamState.FINISHED
        assert recorder.limits == ["max_tokens"]


async def test_backend_finishing_exactly_at_the_limit_keeps_its_own_reason(
    recorder: Recorder,
) -> None:
    async with running_hub(HubSettings(max_tokens_per_stream=3), recorder) as hub:
        stream = await hub.create("words", GenerationRequest(prompt=words(3)))
        events = await read_until_done(hub.open_reader(stream.id, 0))
        assert texts(events) == words(3)
        assert events[-1] == Finished(FinishReason.STOP)
        assert recorder.limits == []


async def test_stream_past_its_maximum_duration_ends_with_usage_and_length(
    recorder: Recorder,
) -> None:
    async with running_hub(HubSettings(max_stream_s=0.3), recorder) as hub:
        request = GenerationRequest(prompt=words(1000), interval_s=0.02)
        stream = await hub.create("words", request)
        events = await asyncio.wait_for(read_until_done(hub.open_reader(stream.id, 0)), 10)
        usage = events[-2]
        assert isinstance(usage, Usage)
        assert 0 < usage.completion_tokens < 1000
        assert events[-1] == Finished(FinishReason.LENGTH)
        assert stream.state is StreamState.FINISHED
        assert stream.finish_reason == "length"
        assert recorder.limits == ["max_duration"]
        assert hub.num_live("anonymous") == 0


@pytest.mark.parametrize(
    "settings",
    [
        {"max_streams_per_tenant": 0},
        {"max_tokens_per_stream": 0},
        {"max_stream_s": 0.0},
        {"retry_after_s": -1.0},
    ],
)
def test_hub_settings_refuse_impossible_limits(settings: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must"):
        HubSettings(**settings)  # type: ignore[arg-type]
