"""The gRPC front against a real ``sluice serve --grpc-port``, with ``grpc.aio`` clients
and ``grpcurl``: the same streams, cursor and rules as the HTTP API."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2
from grpc_status import rpc_status

from sluice.grpc_api import streams_pb2 as pb
from sluice.sse import Decoder
from tests.server import ServerProcess, wait_for_state

pytestmark = pytest.mark.anyio

WAIT_S = 30.0
KEY = "sk-grpc-test-key"
GRPCURL = Path(sys.executable).with_name("grpcurl")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Grpc:
    """A server with its gRPC port."""

    def __init__(self, server: ServerProcess, port: int) -> None:
        self.server = server
        self.target = f"127.0.0.1:{port}"


def serve(*options: str) -> Iterator[Grpc]:
    """A server whose tests compare events one for one: on a loaded machine a gRPC send
    that waits marks its reader lagging, and the next tokens would go merged (coalescing
    has its own tests, on SSE and WebSocket)."""
    port = free_port()
    with ServerProcess("--grpc-port", str(port), "--no-coalesce", *options) as server:
        server.wait_ready()
        yield Grpc(server, port)


@pytest.fixture(scope="module")
def front() -> Iterator[Grpc]:
    yield from serve("--kv-blocks", "128")


@pytest.fixture
async def channel(front: Grpc) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(front.target) as opened:
        yield opened


def generate(channel: grpc.aio.Channel) -> Any:
    return channel.unary_stream(
        "/sluice.v1.Streams/Generate",
        request_serializer=pb.GenerateRequest.SerializeToString,
        response_deserializer=pb.StreamEvent.FromString,
    )


def watch(channel: grpc.aio.Channel) -> Any:
    return channel.unary_stream(
        "/sluice.v1.Streams/Watch",
        request_serializer=pb.WatchRequest.SerializeToString,
        response_deserializer=pb.StreamEvent.FromString,
    )


def cancel(channel: grpc.aio.Channel) -> Any:
    return channel.unary_unary(
        "/sluice.v1.Streams/Cancel",
        request_serializer=pb.CancelRequest.SerializeToString,
        response_deserializer=pb.CancelReply.FromString,
    )


def seq(event: pb.StreamEvent) -> int:
    return int(event.id.rpartition(":")[2])


async def read_all(call: Any) -> list[pb.StreamEvent]:
    return [event async for event in call]


async def read_some(call: Any, count: int) -> list[pb.StreamEvent]:
    events: list[pb.StreamEvent] = []
    async for event in call:
        events.append(event)
        if len(events) == count:
            break
    return events


async def engine_stats(server: ServerProcess) -> dict[str, int]:
    async with httpx.AsyncClient() as http:
        ready = (await http.get(f"{server.base_url}/readyz", timeout=WAIT_S)).json()
    stats: dict[str, int] = ready["engines"]["sluice-tiny"]
    return stats


async def engine_idle(server: ServerProcess) -> dict[str, int]:
    deadline = time.monotonic() + 10
    stats: dict[str, int] = {}
    while time.monotonic() < deadline:
        stats = await engine_stats(server)
        if stats["running"] == stats["waiting"] == stats["kv_blocks_used"] == 0:
            return stats
        await asyncio.sleep(0.02)  # polling an observable condition with a deadline
    raise AssertionError(f"the engine still holds the request: {stats}")


# ---------------------------------------------------------------- the stream


async def test_generate_streams_what_sse_streams_for_the_same_request(
    front: Grpc, channel: grpc.aio.Channel
) -> None:
    request = {"prompt": "one two three", "model": "words", "interval_ms": 0}
    events = await read_all(generate(channel)(pb.GenerateRequest(**request), timeout=WAIT_S))
    async with httpx.AsyncClient(base_url=front.server.base_url, timeout=WAIT_S) as http:
        created = (await http.post("/v1/streams", json=request)).json()
        sse = Decoder().feed((await http.get(created["events_url"])).content)

    assert [e.event for e in events] == [e.event for e in sse]
    assert [e.event for e in events] == ["start", "token", "token", "token", "usage", "done"]
    stream_id = events[0].id.rpartition(":")[0]
    assert [e.id for e in events] == [f"{stream_id}:{n}" for n in range(1, 7)]
    texts = [e.token.text for e in events if e.event == "token"]
    assert texts == [json.loads(e.data)["text"] for e in sse if e.event == "token"]
    assert events[0].start.model == "words"
    assert events[4].usage.completion_tokens == 3
    assert events[-1].done.reason == "stop"
    assert events[1].WhichOneof("payload") == "token"


async def test_initial_metadata_names_the_stream_and_its_resume_token(
    channel: grpc.aio.Channel,
) -> None:
    call = generate(channel)(pb.GenerateRequest(prompt="a b", model="words"), timeout=WAIT_S)
    metadata = dict(await call.initial_metadata())
    events = await read_all(call)
    assert events[0].id.startswith(metadata["sluice-stream-id"] + ":")
    assert metadata["x-sluice-resume-token"]


async def test_a_stream_cut_on_grpc_resumes_on_sse_then_on_grpc_without_gap_or_duplicate(
    front: Grpc, channel: grpc.aio.Channel
) -> None:
    words = [f"w{n}" for n in range(12)]
    request = pb.GenerateRequest(prompt=" ".join(words), model="words", interval_ms=20)
    call = generate(channel)(request, timeout=WAIT_S)
    first = await read_some(call, 4)  # start and three tokens
    call.cancel()  # the cut: a resumable stream waits for its reader
    stream_id = first[0].id.rpartition(":")[0]

    middle = []
    async with (
        httpx.AsyncClient(timeout=WAIT_S) as http,
        http.stream(
            "GET",
            f"{front.server.base_url}/v1/streams/{stream_id}/events",
            headers={"Last-Event-ID": first[-1].id},
        ) as response,
    ):
        decoder = Decoder()
        async for chunk in response.aiter_raw():
            middle += [e for e in decoder.feed(chunk) if e.event == "token"]
            if len(middle) >= 3:
                break
    rest = await read_all(
        watch(channel)(pb.WatchRequest(stream_id=stream_id, last_event_id=middle[-1].id))
    )

    seqs = [seq(e) for e in first] + [int(e.id.rpartition(":")[2]) for e in middle]
    seqs += [seq(e) for e in rest]
    assert seqs == list(range(1, len(seqs) + 1))  # no gap, no duplicate
    texts = [e.token.text for e in first[1:]] + [json.loads(e.data)["text"] for e in middle]
    texts += [e.token.text for e in rest if e.event == "token"]
    assert "".join(texts).split() == words
    assert rest[-1].done.reason == "stop"


async def test_watch_from_the_start_and_past_the_end(channel: grpc.aio.Channel) -> None:
    events = await read_all(
        generate(channel)(pb.GenerateRequest(prompt="x y", model="words"), timeout=WAIT_S)
    )
    stream_id = events[0].id.rpartition(":")[0]
    again = await read_all(watch(channel)(pb.WatchRequest(stream_id=stream_id)))
    assert [e.id for e in again] == [e.id for e in events]
    past = await read_all(
        watch(channel)(pb.WatchRequest(stream_id=stream_id, last_event_id=events[-1].id))
    )
    assert past == []  # nothing after the terminal event: the call ends OK at once


async def test_cancelling_the_rpc_of_a_non_resumable_stream_frees_its_kv_blocks(
    front: Grpc, channel: grpc.aio.Channel
) -> None:
    request = pb.GenerateRequest(
        prompt="the timeout", max_tokens=200, ignore_eos=True, resumable=False
    )
    call = generate(channel)(request, timeout=WAIT_S)
    await read_some(call, 4)
    busy = await engine_stats(front.server)
    assert busy["running"] == 1
    assert busy["kv_blocks_used"] > 0
    call.cancel()
    assert (await engine_idle(front.server))["kv_blocks_used"] == 0


async def test_the_clients_deadline_bounds_the_stream(
    front: Grpc, channel: grpc.aio.Channel
) -> None:
    request = pb.GenerateRequest(
        prompt=" ".join(["tick"] * 200), model="words", interval_ms=20, resumable=False
    )
    call = generate(channel)(request, timeout=0.5)
    stream_id = dict(await call.initial_metadata())["sluice-stream-id"]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await read_all(call)
    assert caught.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_for_state(front.server, stream_id, "cancelled")["tokens"] < 200


async def test_cancel_ends_the_stream_for_its_reader(channel: grpc.aio.Channel) -> None:
    request = pb.GenerateRequest(prompt=" ".join(["tick"] * 200), model="words", interval_ms=20)
    call = generate(channel)(request, timeout=WAIT_S)
    first = await read_some(call, 2)
    stream_id = first[0].id.rpartition(":")[0]
    reply = await cancel(channel)(pb.CancelRequest(stream_id=stream_id), timeout=WAIT_S)
    assert reply.stream_id == stream_id
    assert reply.state == "cancelled"
    rest = await read_all(call)
    assert rest[-1].done.reason == "cancelled"


# ---------------------------------------------------------------- refusals


async def test_bad_input_is_invalid_argument_naming_the_field(
    channel: grpc.aio.Channel,
) -> None:
    cases = [
        (pb.GenerateRequest(prompt="x", max_tokens=0), "max_tokens"),
        (pb.GenerateRequest(prompt="x", top_p=2.0), "top_p"),
        (pb.GenerateRequest(prompt="x", temperature=-1), "temperature"),
    ]
    for request, field in cases:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await read_all(generate(channel)(request, timeout=WAIT_S))
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert field in (caught.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await read_all(watch(channel)(pb.WatchRequest(stream_id="nope")))
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "stream_id" in (caught.value.details() or "")


async def test_an_unknown_model_or_stream_is_not_found(channel: grpc.aio.Channel) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await read_all(generate(channel)(pb.GenerateRequest(prompt="x", model="no-such")))
    assert caught.value.code() is grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await cancel(channel)(pb.CancelRequest(stream_id="str_" + "A" * 22))
    assert caught.value.code() is grpc.StatusCode.NOT_FOUND


async def test_a_full_server_refuses_before_any_message_with_retry_info() -> None:
    for front in serve("--no-model", "--max-streams", "1"):
        async with grpc.aio.insecure_channel(front.target) as channel:
            request = pb.GenerateRequest(
                prompt=" ".join(["tick"] * 200), model="words", interval_ms=20
            )
            holder = generate(channel)(request, timeout=WAIT_S)
            await read_some(holder, 1)
            refused = generate(channel)(request, timeout=WAIT_S)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await read_all(refused)
            holder.cancel()
        error = caught.value
        assert error.code() is grpc.StatusCode.UNAVAILABLE
        trailers = dict(error.trailing_metadata() or ())
        assert int(trailers["grpc-retry-pushback-ms"]) >= 0
        status = rpc_status.from_call(error)
        assert status is not None
        (detail,) = status.details
        info = error_details_pb2.RetryInfo()
        assert detail.Unpack(info)
        assert info.retry_delay.seconds >= 1


async def test_api_keys_in_metadata_and_the_resume_token_for_watch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SLUICE_API_KEYS", f"t:{KEY}")
    for front in serve("--no-model"):
        async with grpc.aio.insecure_channel(front.target) as channel:
            request = pb.GenerateRequest(prompt="a b", model="words")
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await read_all(generate(channel)(request))
            assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED
            keyed = (("authorization", f"Bearer {KEY}"),)
            call = generate(channel)(request, metadata=keyed, timeout=WAIT_S)
            token = dict(await call.initial_metadata())["x-sluice-resume-token"]
            events = await read_all(call)
            stream_id = events[0].id.rpartition(":")[0]
            anonymous_watch = watch(channel)(pb.WatchRequest(stream_id=stream_id))
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await read_all(anonymous_watch)
            assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED
            by_token = watch(channel)(
                pb.WatchRequest(stream_id=stream_id),
                metadata=(("x-sluice-resume-token", str(token)),),
            )
            assert [e.id for e in await read_all(by_token)] == [e.id for e in events]


# ---------------------------------------------------------------- standard services


async def test_health_says_serving(channel: grpc.aio.Channel) -> None:
    check = channel.unary_unary(
        "/grpc.health.v1.Health/Check",
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString,
    )
    for service in ("", "sluice.v1.Streams"):
        reply = await check(health_pb2.HealthCheckRequest(service=service), timeout=WAIT_S)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_grpcurl_lists_the_service_through_reflection_and_streams_a_generate(
    front: Grpc,
) -> None:
    def grpcurl(*args: str) -> str:
        done = subprocess.run(
            [str(GRPCURL), "-plaintext", *args], capture_output=True, timeout=WAIT_S, check=True
        )
        return done.stdout.decode()

    assert "sluice.v1.Streams" in grpcurl(front.target, "list").split()
    methods = grpcurl(front.target, "list", "sluice.v1.Streams").split()
    assert methods == [
        "sluice.v1.Streams.Cancel",
        "sluice.v1.Streams.Generate",
        "sluice.v1.Streams.Watch",
    ]
    body = json.dumps({"prompt": "hello grpc world", "model": "words"})
    output = grpcurl("-d", body, front.target, "sluice.v1.Streams/Generate")
    decoder = json.JSONDecoder()
    events, pos = [], 0
    while pos < len(output.strip()):
        event, end = decoder.raw_decode(output, pos)
        events.append(event)
        pos = end + 1
        while pos < len(output) and output[pos].isspace():
            pos += 1
    assert [e["event"] for e in events] == ["start", "token", "token", "token", "usage", "done"]
    assert "".join(e["token"]["text"] for e in events if e["event"] == "token") == (
        "hello grpc world"
    )
