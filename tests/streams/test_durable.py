"""Durable streams on a hub (no HTTP): their records are in the hub's log and memory
budget, the budget evicts them as it evicts finished streams, and the protocol's rules for
producers, closure, forks and deletion hold."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from sluice.backends.base import GenerationRequest
from sluice.backends.words import WordsBackend
from sluice.errors import DurableStreamError, InvalidParameterError, StreamNotFoundError
from sluice.events import Payload
from sluice.streams import HubSettings, MemoryEventLog, StreamHub
from sluice.streams.durable import (
    MAX_PRODUCERS_PER_STREAM,
    Append,
    Config,
    DurableStreams,
    Fork,
    ProducerRequest,
)
from sluice.streams.reader import wait_for_record

pytestmark = pytest.mark.anyio

TEXT = Config("text/plain")
KiB = 1024


@pytest.fixture
async def durable() -> AsyncIterator[DurableStreams]:
    settings = HubSettings(log_budget_bytes=256 * KiB, max_log_bytes_per_tenant=256 * KiB)
    hub = StreamHub(MemoryEventLog(), {"words": WordsBackend()}, settings)
    async with hub.running():
        yield DurableStreams(hub)


def text(durable: DurableStreams, tenant: str, path: str) -> bytes:
    stream = durable.get(tenant, path)
    batch = durable.hub.log.read(stream.log_id, 0, 1000)
    return b"".join(e.data for e in batch.events if isinstance(e, Payload))


async def test_records_are_in_the_hubs_log_and_counted_in_its_budget(
    durable: DurableStreams,
) -> None:
    memory = durable.hub.memory
    before = memory.num_bytes
    stream, created = await durable.create("a", "/s", TEXT, [Payload(b"x" * 4096)], False)
    assert created
    assert memory.bytes_of("a") == memory.num_bytes - before >= 4096
    await durable.append(stream, Append([Payload(b"y" * 4096)]))
    assert memory.bytes_of("a") >= 8192
    assert durable.hub.log.last_seq(stream.log_id) == 2
    assert memory.num_live_of("a") == 0  # it pins no model slot: held as a retained log
    durable.delete(stream)
    assert memory.bytes_of("a") == 0
    with pytest.raises(StreamNotFoundError):
        durable.get("a", "/s")


async def test_the_budget_evicts_the_oldest_durable_stream_to_make_room(
    durable: DurableStreams,
) -> None:
    """256 KiB of budget: a fourth stream of 80 KiB evicts the first, which is then gone."""
    for name in ("/1", "/2", "/3", "/4"):
        stream, _ = await durable.create("a", name, TEXT, [], False)
        await durable.append(stream, Append([Payload(b"z" * 80 * KiB)]))
    with pytest.raises(StreamNotFoundError):
        durable.get("a", "/1")
    assert text(durable, "a", "/4") == b"z" * 80 * KiB
    assert durable.hub.memory.evictions.get("log_memory", 0) >= 1
    assert durable.hub.memory.num_bytes <= 256 * KiB


async def test_a_generation_that_needs_room_evicts_durable_streams_first(
    durable: DurableStreams,
) -> None:
    """Durable streams are retained logs: a live generation growing past the budget
    evicts them (oldest first) before it is trimmed itself."""
    hub = durable.hub
    for name in ("/1", "/2", "/3"):
        await durable.create("a", name, TEXT, [Payload(b"q" * 80 * KiB)], False)
    llm = await hub.create("words", GenerationRequest(prompt="w " * 5000), tenant="a")
    while not llm.is_terminal:
        await wait_for_record(hub.log, llm.id, hub.log.last_seq(llm.id))
    for name in ("/1", "/2", "/3"):
        with pytest.raises(StreamNotFoundError):
            durable.get("a", name)
    assert hub.memory.evictions["log_memory"] == 3
    assert len(durable) == 0


async def test_paths_are_per_tenant(durable: DurableStreams) -> None:
    await durable.create("a", "/s", TEXT, [Payload(b"a's")], False)
    with pytest.raises(StreamNotFoundError):
        durable.get("b", "/s")
    await durable.create("b", "/s", TEXT, [Payload(b"b's")], False)
    assert text(durable, "a", "/s") == b"a's"
    assert text(durable, "b", "/s") == b"b's"


async def test_a_put_of_another_configuration_conflicts(durable: DurableStreams) -> None:
    await durable.create("a", "/s", Config("text/plain", ttl_s=60), [], False)
    same, created = await durable.create("a", "/s", Config("TEXT/PLAIN", ttl_s=60), [], False)
    assert not created
    assert same.content_type == "text/plain"
    for other in (Config("application/json", ttl_s=60), Config("text/plain"), TEXT):
        with pytest.raises(DurableStreamError) as refused:
            await durable.create("a", "/s", other, [], False)
        assert refused.value.status == 409


async def test_producer_rules_fence_deduplicate_and_detect_gaps(durable: DurableStreams) -> None:
    stream, _ = await durable.create("a", "/p", TEXT, [], False)

    async def send(epoch: int, seq: int, data: bytes) -> int:
        done = await durable.append(
            stream, Append([Payload(data)], producer=ProducerRequest("p", epoch, seq))
        )
        return done.status

    assert await send(0, 0, b"a") == 200
    assert await send(0, 0, b"a") == 204  # a retry: not appended again
    assert await send(0, 1, b"b") == 200
    with pytest.raises(DurableStreamError) as gap:
        await send(0, 3, b"d")
    assert gap.value.status == 409
    assert dict(gap.value.headers) == {"Producer-Expected-Seq": "2", "Producer-Received-Seq": "3"}
    assert await send(1, 0, b"c") == 200  # a new epoch
    with pytest.raises(DurableStreamError) as stale:
        await send(0, 2, b"zombie")
    assert (stale.value.status, dict(stale.value.headers)) == (403, {"Producer-Epoch": "1"})
    with pytest.raises(InvalidParameterError):
        await send(2, 5, b"bad")
    assert text(durable, "a", "/p") == b"abc"


async def test_a_closed_stream_refuses_appends_but_its_closer_may_retry(
    durable: DurableStreams,
) -> None:
    stream, _ = await durable.create("a", "/c", TEXT, [Payload(b"x")], False)
    closer = ProducerRequest("p", 0, 0)
    done = await durable.append(stream, Append([Payload(b"end")], close=True, producer=closer))
    assert (done.status, done.closed, done.next_seq) == (200, True, 2)
    retry = await durable.append(stream, Append([Payload(b"other")], close=True, producer=closer))
    assert (retry.status, retry.next_seq) == (204, 2)
    assert (await durable.append(stream, Append([], close=True))).status == 204
    with pytest.raises(DurableStreamError) as refused:
        await durable.append(stream, Append([Payload(b"late")]))
    assert refused.value.status == 409
    assert ("Stream-Closed", "true") in refused.value.headers
    assert text(durable, "a", "/c") == b"xend"


async def test_a_fork_copies_up_to_its_offset_and_keeps_its_source_soft_deleted(
    durable: DurableStreams,
) -> None:
    source, _ = await durable.create("a", "/src", TEXT, [Payload(b"hello")], False)
    await durable.append(source, Append([Payload(b" world")]))
    fork_config = Config(None, fork=Fork("/src", 1, 3))
    fork, _ = await durable.create("a", "/fork", fork_config, [Payload(b"!")], False)
    assert fork.content_type == "text/plain"
    assert text(durable, "a", "/fork") == b"hello wo!"
    durable.delete(source)
    with pytest.raises(DurableStreamError) as gone:
        durable.get("a", "/src")
    assert gone.value.status == 410
    with pytest.raises(DurableStreamError):  # the path stays taken while forks name it
        await durable.create("a", "/src", TEXT, [], False)
    durable.delete(fork)
    with pytest.raises(StreamNotFoundError):  # its last fork gone, the source goes too
        durable.get("a", "/src")
    assert durable.hub.memory.bytes_of("a") == 0
    with pytest.raises(StreamNotFoundError):
        await durable.create("a", "/f2", Config(None, fork=Fork("/nowhere", None)), [], False)


async def test_a_sub_offset_past_the_next_record_is_refused(durable: DurableStreams) -> None:
    await durable.create("a", "/src", TEXT, [Payload(b"hi")], False)
    with pytest.raises(InvalidParameterError):
        await durable.create("a", "/f", Config(None, fork=Fork("/src", 0, 3)), [], False)
    await durable.create("a", "/f", Config(None, fork=Fork("/src", 0, 2)), [], False)
    assert text(durable, "a", "/f") == b"hi"
    with pytest.raises(InvalidParameterError):  # nothing after the tail to cut
        await durable.create("a", "/g", Config(None, fork=Fork("/src", 1, 1)), [], False)


async def test_producer_state_is_bounded_per_stream(durable: DurableStreams) -> None:
    stream, _ = await durable.create("a", "/many", TEXT, [], False)
    for i in range(MAX_PRODUCERS_PER_STREAM + 1):
        request = Append([Payload(b".")], producer=ProducerRequest(f"p{i}", 0, 0))
        assert (await durable.append(stream, request)).status == 200
    assert len(stream.producers) == MAX_PRODUCERS_PER_STREAM
    assert "p0" not in stream.producers  # the least recent is forgotten: new again
    again = await durable.append(
        stream, Append([Payload(b"!")], producer=ProducerRequest("p0", 0, 0))
    )
    assert again.status == 200
