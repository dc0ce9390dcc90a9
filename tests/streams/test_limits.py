"""The hub's limits: live streams per tenant, tokens per stream, stream duration, and the
event logs' memory (the server-wide budget, tenants' bytes and retained streams, eviction)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from sluice.backends.base import Delta, GenerationRequest
from sluice.backends.words import WordsBackend
from sluice.errors import CapacityError, ResumeGapError, StreamNotFoundError, TenantLimitError
from sluice.events import Finished, FinishReason, NeutralEvent, Started, TextDelta, Usage
from sluice.streams import HubSettings, MemoryEventLog, Stream, StreamHub, StreamState
from sluice.transports.frames import FrameCache
from tests.streams.reading import read_until, read_until_done

pytestmark = pytest.mark.anyio


class Recorder:
    """A stream observer that keeps what it is told about limits."""

    def __init__(self) -> None:
        self.limits: list[str] = []
        self.evictions: list[tuple[str, str]] = []  # stream id, reason

    def started(self, stream: object, queued_s: float) -> None: ...

    def tokens(self, stream: object, count: int, since_s: float, first: bool) -> None: ...

    def finished(self, stream: object, outcome: str, e2e_s: float) -> None: ...

    def refused(self, stream: object, reason: str) -> None: ...

    def send_timed_out(self) -> None: ...

    def coalesced_events(self, count: int) -> None: ...

    def token_write_gap(self, model: str, gap_s: float) -> None: ...

    def limited(self, stream: object, limit: str) -> None:
        self.limits.append(limit)

    def evicted(self, stream: Stream, reason: str) -> None:
        self.evictions.append((stream.id, reason))


@pytest.fixture
async def recorder() -> Recorder:
    return Recorder()


@contextlib.asynccontextmanager
async def running_hub(settings: HubSettings, recorder: Recorder) -> AsyncIterator[StreamHub]:
    backends = {"words": WordsBackend(), "held": HeldBackend()}
    # As the app composes it: the delivery layer's frames are counted with each record.
    log = MemoryEventLog(observer=FrameCache())
    hub = StreamHub(log, backends, settings, recorder)  # type: ignore[arg-type]
    async with hub.running():
        yield hub


class HeldGeneration:
    """Sends the prompt's words in one delta, then holds the stream live until aborted."""

    def __init__(self, request: GenerationRequest) -> None:
        self._words = request.prompt.split()
        self._aborted = asyncio.Event()

    async def start(self) -> None: ...

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._run()

    async def _run(self) -> AsyncIterator[Delta]:
        yield Delta([TextDelta(word) for word in self._words])
        await self._aborted.wait()

    async def abort(self) -> None:
        self._aborted.set()

    def usage(self) -> Usage:
        return Usage(len(self._words), len(self._words))


class HeldBackend:
    model = "held"

    def generate(self, request: GenerationRequest) -> HeldGeneration:
        return HeldGeneration(request)

    async def aclose(self) -> None: ...


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


# -- the event logs' memory --------------------------------------------------------------


async def finish(hub: StreamHub, tenant: str = "anonymous", num_words: int = 200) -> Stream:
    """A stream of ``num_words`` tokens, read to its end (a one-word token's record holds
    about 240 bytes: 200 of them about 49 kB)."""
    stream = await hub.create("words", GenerationRequest(prompt=words(num_words)), tenant=tenant)
    reader = hub.open_reader(stream.id, 0)
    await read_until_done(reader)
    reader.close()
    return stream


async def until_terminal(hub: StreamHub, stream: Stream) -> None:
    """Wait, without reading, for the stream's producer to end it."""
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(10):
        while not stream.is_terminal:
            waiter: asyncio.Future[None] = loop.create_future()
            hub.log.watch(stream.id, hub.log.last_seq(stream.id), waiter)
            try:
                await waiter
            finally:
                hub.log.unwatch(stream.id, waiter)


def gone(hub: StreamHub, stream: Stream) -> bool:
    try:
        hub.get(stream.id)
    except StreamNotFoundError:
        with pytest.raises(StreamNotFoundError):
            hub.log.num_bytes(stream.id)  # its log went with it
        return True
    return False


def held_bytes(hub: StreamHub, streams: list[Stream]) -> int:
    return sum(hub.log.num_bytes(s.id) for s in streams if not gone(hub, s))


async def test_finished_streams_past_the_log_budget_are_evicted_oldest_first(
    recorder: Recorder,
) -> None:
    settings = HubSettings(log_budget_bytes=220_000, max_log_bytes_per_tenant=220_000)
    async with running_hub(settings, recorder) as hub:
        streams = [await finish(hub) for _ in range(8)]
        assert hub.memory.num_bytes == held_bytes(hub, streams) <= 220_000
        evicted = [stream_id for stream_id, _ in recorder.evictions]
        assert evicted == [s.id for s in streams[: len(evicted)]]  # the oldest, in order
        assert len(evicted) >= 4
        assert {reason for _, reason in recorder.evictions} == {"log_memory"}
        assert all(gone(hub, s) for s in streams[: len(evicted)])
        newest = await read_until_done(hub.open_reader(streams[-1].id, 0))
        assert newest[0] == Started("words", int(streams[-1].created), prompt_tokens=200)
        assert texts(newest) == words(200)
        assert hub.memory.evictions == {"log_memory": len(evicted)}


async def test_a_stream_needing_room_evicts_its_own_tenants_streams_first(
    recorder: Recorder,
) -> None:
    settings = HubSettings(log_budget_bytes=220_000, max_log_bytes_per_tenant=220_000)
    async with running_hub(settings, recorder) as hub:
        a1 = await finish(hub, "a")
        b1 = await finish(hub, "b")
        a2 = await finish(hub, "a")
        b2 = await finish(hub, "b")
        assert recorder.evictions == []
        await finish(hub, "a")
        assert recorder.evictions == [(a1.id, "log_memory")]  # not b1, the oldest of all
        await finish(hub, "a")
        assert recorder.evictions[1] == (a2.id, "log_memory")
        assert not gone(hub, b1)
        assert not gone(hub, b2)


async def test_a_tenant_over_its_log_bytes_evicts_its_own_and_spares_the_others(
    recorder: Recorder,
) -> None:
    settings = HubSettings(log_budget_bytes=10_000_000, max_log_bytes_per_tenant=120_000)
    async with running_hub(settings, recorder) as hub:
        b_streams = [await finish(hub, "b") for _ in range(2)]
        a_streams = [await finish(hub, "a") for _ in range(5)]
        assert hub.memory.bytes_of("a") <= 120_000
        assert {reason for _, reason in recorder.evictions} == {"tenant_log_bytes"}
        assert [i for i, _ in recorder.evictions] == [s.id for s in a_streams[:3]]
        assert not any(gone(hub, s) for s in b_streams)


async def test_a_tenant_past_its_retained_streams_loses_its_oldest(recorder: Recorder) -> None:
    async with running_hub(HubSettings(max_retained_per_tenant=2), recorder) as hub:
        a1 = await finish(hub, "a", num_words=3)
        b1 = await finish(hub, "b", num_words=3)
        await finish(hub, "a", num_words=3)
        assert recorder.evictions == []
        await finish(hub, "a", num_words=3)
        assert recorder.evictions == [(a1.id, "tenant_retained_streams")]
        assert hub.memory.retained_of("a") == 2
        assert not gone(hub, b1)


async def test_retained_streams_never_stop_another_tenant_creating_one(
    recorder: Recorder,
) -> None:
    """The server's stream count is full of a's finished streams: b's creation evicts the
    oldest of them instead of being refused. Live streams still count fully."""
    settings = HubSettings(max_streams=3, max_streams_per_tenant=3)
    async with running_hub(settings, recorder) as hub:
        a_streams = [await finish(hub, "a", num_words=3) for _ in range(3)]
        slow = GenerationRequest(prompt=words(50), interval_s=60)
        await hub.create("words", slow, tenant="b")
        assert recorder.evictions == [(a_streams[0].id, "max_streams")]
        await hub.create("words", slow, tenant="b")
        await hub.create("words", slow, tenant="c")
        assert len(hub) == 3
        assert hub.memory.num_retained == 0
        with pytest.raises(CapacityError, match="too many streams"):
            await hub.create("words", slow, tenant="d")


async def test_live_streams_filling_the_budget_refuse_new_streams(recorder: Recorder) -> None:
    settings = HubSettings(
        log_budget_bytes=100_000, max_log_bytes_per_tenant=100_000, retry_after_s=3.0
    )
    async with running_hub(settings, recorder) as hub:
        retained = await finish(hub, "b")
        held = await hub.create("held", GenerationRequest(prompt=words(380)), tenant="a")
        await read_until(hub.open_reader(held.id, 0), lambda events: len(events) > 380)
        # The live stream's growth evicted the retained one: nothing else can give room.
        assert recorder.evictions == [(retained.id, "log_memory")]
        assert 90_000 < hub.memory.num_bytes <= 100_000
        with pytest.raises(CapacityError) as refused:
            await hub.create("words", GenerationRequest(prompt="x"), tenant="c")
        assert not isinstance(refused.value, TenantLimitError)  # the server's limit: 503
        assert refused.value.reason == "log_memory"
        assert refused.value.retry_after_s == 3.0
        assert "memory" in str(refused.value)
        assert len(recorder.evictions) == 1


async def test_a_tenants_live_streams_filling_its_bytes_refuse_its_new_streams(
    recorder: Recorder,
) -> None:
    settings = HubSettings(log_budget_bytes=10_000_000, max_log_bytes_per_tenant=60_000)
    async with running_hub(settings, recorder) as hub:
        held = await hub.create("held", GenerationRequest(prompt=words(230)), tenant="a")
        await read_until(hub.open_reader(held.id, 0), lambda events: len(events) > 230)
        with pytest.raises(TenantLimitError) as refused:
            await hub.create("words", GenerationRequest(prompt="x"), tenant="a")
        assert refused.value.tenant == "a"
        assert "event logs" in str(refused.value)
        await hub.create("words", GenerationRequest(prompt="x"), tenant="b")


async def test_a_live_stream_growing_past_the_budget_trims_its_oldest_events(
    recorder: Recorder,
) -> None:
    settings = HubSettings(log_budget_bytes=100_000, max_log_bytes_per_tenant=100_000)
    async with running_hub(settings, recorder) as hub:
        stream = await hub.create("words", GenerationRequest(prompt=words(3000)))
        await until_terminal(hub, stream)
        assert hub.memory.num_bytes == hub.log.num_bytes(stream.id) <= 100_000
        assert hub.memory.num_trims > 0
        with pytest.raises(ResumeGapError):
            hub.open_reader(stream.id, 0).read(10)
        # Its creator, looking only now, still learns that it started.
        assert await hub.first_event(stream.id) == Started(
            "words", int(stream.created), prompt_tokens=3000
        )
        tail = await read_until_done(hub.open_reader(stream.id, hub.log.last_seq(stream.id) - 3))
        assert tail[-1] == Finished(FinishReason.STOP)


async def test_every_byte_is_given_back_when_the_streams_are_forgotten(
    recorder: Recorder,
) -> None:
    settings = HubSettings(retention_s=0.0, log_budget_bytes=150_000)
    async with running_hub(settings, recorder) as hub:
        for tenant in ("a", "b", "a"):
            stream = await finish(hub, tenant)
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            hub.log.watch(stream.id, hub.log.last_seq(stream.id), waiter)
            await asyncio.wait_for(waiter, 5)  # resolved when retention deletes the log
        assert (len(hub), len(hub.memory), hub.memory.num_bytes) == (0, 0, 0)
        assert hub.memory.bytes_of("a") == hub.memory.num_live == 0


@pytest.mark.parametrize(
    "settings",
    [{"log_budget_bytes": 0}, {"max_log_bytes_per_tenant": 0}, {"max_retained_per_tenant": 0}],
)
def test_hub_settings_refuse_impossible_memory_limits(settings: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="must"):
        HubSettings(**settings)
