"""StreamHub lifecycle: producers, readers, cancel, grace windows, retention."""

from __future__ import annotations

import asyncio

import pytest

from sluice.backends.base import GenerationRequest
from sluice.backends.words import WordsBackend, WordsGeneration
from sluice.errors import (
    BadRequestError,
    CapacityError,
    IllegalTransitionError,
    StreamNotFoundError,
)
from sluice.events import Error, Finished, FinishReason, NeutralEvent, Started, TextDelta, Usage
from sluice.streams import HubSettings, MemoryEventLog, StreamHub, StreamState
from sluice.streams.state import next_state
from tests.streams.reading import read_until_done

pytestmark = pytest.mark.anyio


class RecordingWords(WordsBackend):
    """The words backend, keeping its generations so tests can see whether they stopped."""

    def __init__(self) -> None:
        super().__init__()
        self.generations: list[WordsGeneration] = []

    def generate(self, request: GenerationRequest) -> WordsGeneration:
        generation = super().generate(request)
        self.generations.append(generation)
        return generation


def texts(events: list[NeutralEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


async def test_stream_runs_to_one_terminal_event_and_text_equals_prompt(hub: StreamHub) -> None:
    prompt = "  the quick\tbrown fox\n jumps  "
    stream = await hub.create("words", GenerationRequest(prompt))
    reader = hub.open_reader(stream.id, 0)
    events = await read_until_done(reader)
    reader.close()
    assert isinstance(events[0], Started)
    assert texts(events) == prompt
    assert events[-2:] == [Usage(5, 5), Finished(FinishReason.STOP)]
    assert stream.state is StreamState.FINISHED
    assert stream.finish_reason == "stop"


async def test_max_tokens_ends_with_length(hub: StreamHub) -> None:
    stream = await hub.create("words", GenerationRequest("a b c d e", max_tokens=2))
    events = await read_until_done(hub.open_reader(stream.id, 0))
    assert texts(events) == "a b"
    assert events[-1] == Finished(FinishReason.LENGTH)


async def test_explicit_cancel_stops_the_producer_with_one_terminal_event() -> None:
    backend = RecordingWords()
    hub = StreamHub(MemoryEventLog(), {"words": backend}, HubSettings(default_grace_s=30))
    async with hub.running():
        stream = await hub.create("words", GenerationRequest("w " * 1000, interval_s=0.01))
        reader = hub.open_reader(stream.id, 0)
        seen: list[NeutralEvent] = []
        while len(seen) < 4:  # start + 3 tokens
            seen.extend((reader.read(100)).events)
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            reader.watch(waiter)
            await waiter
            reader.unwatch(waiter)
        hub.cancel(stream.id)
        events = seen + await read_until_done(reader)
        generation = backend.generations[0]
        emitted = generation.num_emitted
        terminals = [e for e in events if isinstance(e, Finished)]
        assert terminals == [Finished(FinishReason.CANCELLED)]
        assert events[-1] == Finished(FinishReason.CANCELLED)
        assert events[-2] == Usage(1000, emitted)
        assert emitted < 1000
        assert stream.state is StreamState.CANCELLED
        assert hub.cancel(stream.id) is stream  # idempotent
        assert hub.log.last_seq(stream.id) == len(events)


async def test_cancel_before_the_producer_starts_still_writes_the_terminal(
    hub: StreamHub,
) -> None:
    stream = await hub.create("words", GenerationRequest("never said"))
    hub.cancel(stream.id)  # the producer task has not run yet
    events = await read_until_done(hub.open_reader(stream.id, 0))
    assert events == [Usage(2, 0), Finished(FinishReason.CANCELLED)]
    assert stream.state is StreamState.CANCELLED


async def test_last_reader_leaving_a_non_resumable_stream_cancels_it_at_once(
    hub: StreamHub,
) -> None:
    stream = await hub.create(
        "words", GenerationRequest("w " * 100, interval_s=0.05), resumable=False
    )
    first = hub.open_reader(stream.id, 0)
    second = hub.open_reader(stream.id, 0)
    first.close()
    assert not stream.cancel_requested
    second.close()
    assert stream.cancel_requested
    events = await read_until_done(hub.open_reader(stream.id, 0))
    assert events[-1] == Finished(FinishReason.CANCELLED)


async def test_resumable_stream_survives_a_reader_that_returns_within_grace(
    hub: StreamHub,
) -> None:
    stream = await hub.create("words", GenerationRequest("w " * 10, interval_s=0.1), grace_s=5)
    hub.open_reader(stream.id, 0).close()
    assert stream.timer is not None
    reader = hub.open_reader(stream.id, 0)
    assert stream.timer is None
    events = await read_until_done(reader)
    assert events[-1] == Finished(FinishReason.STOP)


async def test_resumable_stream_is_cancelled_when_grace_ends_without_reader(
    hub: StreamHub,
) -> None:
    stream = await hub.create("words", GenerationRequest("w " * 100, interval_s=60), grace_s=0.2)
    hub.open_reader(stream.id, 0).close()
    assert not stream.cancel_requested
    assert await terminal_without_reading(hub, stream.id) == Finished(FinishReason.CANCELLED)


async def terminal_without_reading(hub: StreamHub, stream_id: str) -> NeutralEvent:
    """Wait for the stream's terminal event through the log, without attaching a reader."""
    after = 0
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(10):
        while True:
            batch = hub.log.read(stream_id, after, 100)
            after = batch.last_seq
            for event in batch.events:
                if isinstance(event, Finished):
                    return event
            waiter: asyncio.Future[None] = loop.create_future()
            hub.log.watch(stream_id, after, waiter)
            await waiter


async def test_stream_nobody_reads_is_cancelled_after_its_first_grace_window(
    hub: StreamHub,
) -> None:
    stream = await hub.create("words", GenerationRequest("w " * 100, interval_s=60), grace_s=0.1)
    assert await terminal_without_reading(hub, stream.id) == Finished(FinishReason.CANCELLED)


async def test_unknown_model_and_bad_grace_are_refused(hub: StreamHub) -> None:
    with pytest.raises(BadRequestError, match="unknown model 'gpt-9'"):
        await hub.create("gpt-9", GenerationRequest("x"))
    with pytest.raises(BadRequestError, match="grace_s"):
        await hub.create("words", GenerationRequest("x"), grace_s=10**9)


async def test_capacity_is_bounded() -> None:
    hub = StreamHub(MemoryEventLog(), {"words": WordsBackend()}, HubSettings(max_streams=2))
    async with hub.running():
        await hub.create("words", GenerationRequest("a", interval_s=1))
        await hub.create("words", GenerationRequest("b", interval_s=1))
        with pytest.raises(CapacityError) as refused:
            await hub.create("words", GenerationRequest("c"))
        assert refused.value.retry_after_s > 0


async def test_finished_stream_is_forgotten_after_retention() -> None:
    hub = StreamHub(MemoryEventLog(), {"words": WordsBackend()}, HubSettings(retention_s=0.05))
    async with hub.running():
        stream = await hub.create("words", GenerationRequest("a b"))
        reader = hub.open_reader(stream.id, 0)
        await read_until_done(reader)
        reader.close()
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        hub.log.watch(stream.id, hub.log.last_seq(stream.id), waiter)
        await asyncio.wait_for(waiter, timeout=5)  # resolved when retention deletes the log
        with pytest.raises(StreamNotFoundError):
            hub.get(stream.id)
        with pytest.raises(StreamNotFoundError):
            hub.log.last_seq(stream.id)


async def test_leaving_the_hub_cancels_live_streams_and_ends_them() -> None:
    backend = RecordingWords()
    log = MemoryEventLog()
    hub = StreamHub(log, {"words": backend}, HubSettings())
    async with hub.running():
        stream = await hub.create("words", GenerationRequest("w " * 100, interval_s=0.05))
    assert stream.state is StreamState.CANCELLED
    assert backend.generations[0].num_emitted < 100
    assert len(hub) == 0


def test_state_table_refuses_illegal_transitions() -> None:
    assert next_state("s", StreamState.QUEUED, StreamState.RUNNING) is StreamState.RUNNING
    with pytest.raises(IllegalTransitionError, match="finished -> running"):
        next_state("s", StreamState.FINISHED, StreamState.RUNNING)
    with pytest.raises(IllegalTransitionError, match="running -> queued"):
        next_state("s", StreamState.RUNNING, StreamState.QUEUED)


class RefusingGeneration:
    """A generation whose backend refuses the work when it starts."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.aborted = False

    async def start(self) -> None:
        raise self.error

    def __aiter__(self) -> RefusingGeneration:
        return self

    async def __anext__(self) -> object:
        raise AssertionError("iterated after start() refused")

    async def abort(self) -> None:
        self.aborted = True

    def usage(self) -> Usage:
        return Usage(0, 0)


class RefusingBackend:
    def __init__(self, error: Exception) -> None:
        self.error = error

    @property
    def model(self) -> str:
        return "refusing"

    def generate(self, request: GenerationRequest) -> RefusingGeneration:
        return RefusingGeneration(self.error)

    async def aclose(self) -> None:
        return None


@pytest.mark.parametrize(
    ("error", "code", "retryable"),
    [
        (CapacityError("engine queue is full", retry_after_s=1), "overloaded", True),
        (BadRequestError("prompt too long"), "invalid_request", False),
    ],
)
async def test_a_backend_refusal_ends_the_stream_with_a_clear_error(
    error: Exception, code: str, retryable: bool
) -> None:
    hub = StreamHub(MemoryEventLog(), {"refusing": RefusingBackend(error)}, HubSettings())
    async with hub.running():
        stream = await hub.create("refusing", GenerationRequest("x"))
        events = await read_until_done(hub.open_reader(stream.id, 0))
    assert events == [Error(code, str(error), retryable)]  # refused before it started
    assert stream.state is StreamState.FAILED
