"""``sluice worker`` against a ``grpc.aio`` client of vLLM's engine protocol: what it says
about its model, the engine's greedy tokens as ids, and every way a request can end early
(cancel, deadline, ``Abort``) freeing the engine's KV blocks."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest

from sluice.engine.engine import Engine, EngineConfig
from sluice.engine.loader import load_checkpoint
from sluice.engine.sampling_params import SamplingParams
from sluice.vllm_grpc.proto import common_pb2
from sluice.vllm_grpc.proto import vllm_engine_pb2 as pb
from sluice.vllm_grpc.servicer import REQUEST_ID_METADATA
from sluice.vllm_grpc.tokenizer_bundle import read_bundle
from tests.server import TEST_MODEL
from tests.worker_process import EngineCalls, WorkerProcess, token_ids, worker_idle

# Worker processes load torch and a model: slow to start on a busy 2-core machine.
pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]

PROMPT = "Return the number of items in the sequence"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    with WorkerProcess("--kv-blocks", "64") as process:
        yield process


@pytest.fixture
async def calls(worker: WorkerProcess) -> AsyncIterator[EngineCalls]:
    async with grpc.aio.insecure_channel(worker.target) as channel:
        yield EngineCalls(channel)


def greedy_ids(prompt_ids: list[int], max_tokens: int) -> list[int]:
    """The in-process engine's greedy completion of ``prompt_ids``."""
    checkpoint = load_checkpoint(TEST_MODEL)
    tokenizer = checkpoint.tokenizer
    config = EngineConfig.for_serving(256, num_blocks=64, max_num_seqs=4)
    engine = Engine(
        checkpoint.model,
        config,
        eos_token_id=tokenizer.eos_token_ids,
        token_bytes=tokenizer.token_bytes,
    )
    engine.add_request(prompt_ids, SamplingParams(max_tokens, temperature=0, ignore_eos=True))
    ids: list[int] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            ids.extend(output.new_token_ids)
    return ids


def long_request(request_id: str, max_tokens: int = 200) -> pb.GenerateRequest:
    tokenizer = load_checkpoint(TEST_MODEL).tokenizer
    return pb.GenerateRequest(
        request_id=request_id,
        tokenized=pb.TokenizedInput(input_ids=tokenizer.encode(PROMPT)),
        sampling_params=pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
        stream=True,
    )


async def test_the_worker_describes_its_model_and_ships_its_tokenizer(
    calls: EngineCalls,
) -> None:
    checkpoint = load_checkpoint(TEST_MODEL)
    info = await calls.get_model_info(pb.GetModelInfoRequest())
    assert info.served_model_name == "sluice-tiny"
    assert info.max_context_length == 256
    assert list(info.eos_token_ids) == list(checkpoint.tokenizer.eos_token_ids)
    assert info.architectures == ["GPT2LMHeadModel"]
    chunks = [chunk async for chunk in calls.get_tokenizer(common_pb2.GetTokenizerRequest())]
    bundle = b"".join(chunk.data for chunk in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(bundle).hexdigest()
    assert all(not chunk.sha256 for chunk in chunks[:-1])
    files = read_bundle(bundle)
    assert files.tokenizer.encode(PROMPT) == checkpoint.tokenizer.encode(PROMPT)
    assert files.tokenizer.eos_token_ids == checkpoint.tokenizer.eos_token_ids
    assert files.chat_template == checkpoint.chat_template
    health = await calls.health_check(pb.HealthCheckRequest())
    assert health.healthy


async def test_generate_streams_the_engines_greedy_token_ids(calls: EngineCalls) -> None:
    request = long_request("greedy-ids", max_tokens=12)
    call = calls.generate(request)
    metadata = await call.initial_metadata()
    assert (REQUEST_ID_METADATA, "greedy-ids") in list(metadata or ())
    responses = [response async for response in call]
    kinds = [response.WhichOneof("response") for response in responses]
    assert kinds[-1] == "complete"
    assert set(kinds[:-1]) == {"chunk"}
    complete = responses[-1].complete
    assert complete.finish_reason == "length"
    assert complete.prompt_tokens == len(request.tokenized.input_ids)
    assert token_ids(responses) == greedy_ids(list(request.tokenized.input_ids), 12)
    # As vLLM's servicer: the complete repeats the last chunk's ids.
    assert list(complete.output_ids) == list(responses[-2].chunk.token_ids)


async def test_a_request_that_is_not_streamed_gets_one_complete_with_every_id(
    calls: EngineCalls,
) -> None:
    request = long_request("not-streamed", max_tokens=6)
    request.stream = False
    responses = [response async for response in calls.generate(request)]
    assert [response.WhichOneof("response") for response in responses] == ["complete"]
    ids = greedy_ids(list(request.tokenized.input_ids), 6)
    assert list(responses[0].complete.output_ids) == ids
    assert responses[0].complete.completion_tokens == 6


async def test_a_stop_string_ends_the_request_and_is_named(calls: EngineCalls) -> None:
    tokenizer = load_checkpoint(TEST_MODEL).tokenizer
    request = long_request("stop-string", max_tokens=40)
    first = [response async for response in calls.generate(request)]
    text = b"".join(tokenizer.token_bytes(t) for t in token_ids(first)).decode()
    stop = text.split()[3]  # a word the greedy answer writes
    request = long_request("stop-string-2", max_tokens=40)
    request.sampling_params.stop.append(stop)
    responses = [response async for response in calls.generate(request)]
    complete = responses[-1].complete
    assert complete.finish_reason == "stop"
    assert complete.matched_stop_str == stop
    assert len(token_ids(responses)) < 40


async def test_a_cancelled_call_frees_its_kv_blocks(calls: EngineCalls) -> None:
    call = calls.generate(long_request("cancelled"))
    await call.read()
    await call.read()
    busy = (await calls.get_loads(pb.GetLoadsRequest())).loads[0]
    assert busy.num_running_reqs == 1
    assert busy.num_used_tokens > 0
    call.cancel()
    assert await call.code() is grpc.StatusCode.CANCELLED
    assert (await worker_idle(calls)).num_used_tokens == 0


async def test_the_deadline_aborts_the_request(calls: EngineCalls) -> None:
    call = calls.generate(long_request("deadline"), timeout=0.3)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async for _ in call:
            pass
    assert raised.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    await worker_idle(calls)


async def test_abort_ends_a_live_request_with_abort(calls: EngineCalls) -> None:
    call = calls.generate(long_request("aborted"))
    await call.read()
    await calls.abort(pb.AbortRequest(request_ids=["aborted", "unknown"]))
    # Answered once the engine applied it: its blocks are free already.
    load = (await calls.get_loads(pb.GetLoadsRequest())).loads[0]
    assert load.num_running_reqs == load.num_used_tokens == 0
    responses = []
    while (response := await call.read()) is not grpc.aio.EOF:
        responses.append(response)
    assert responses[-1].complete.finish_reason == "abort"


async def test_what_the_engine_cannot_honour_is_refused_naming_the_field(
    calls: EngineCalls,
) -> None:
    request = long_request("penalty")
    request.sampling_params.frequency_penalty = 0.5
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async for _ in calls.generate(request):
            pass
    assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "frequency_penalty" in (raised.value.details() or "")
    request = long_request("too-long", max_tokens=300)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async for _ in calls.generate(request):
            pass
    assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "max_model_len" in (raised.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await calls.embed(pb.EmbedRequest(request_id="e"))
    assert raised.value.code() is grpc.StatusCode.UNIMPLEMENTED


async def test_a_duplicate_live_request_id_is_refused(calls: EngineCalls) -> None:
    first = calls.generate(long_request("twice"))
    await first.read()
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async for _ in calls.generate(long_request("twice")):
            pass
    assert raised.value.code() is grpc.StatusCode.ALREADY_EXISTS
    first.cancel()
    await worker_idle(calls)
