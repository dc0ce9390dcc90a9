"""The engine backend behind a real StreamHub: text, usage and finish reasons from a small
random GPT-2 with a byte-level tokenizer trained here; a cancel mid-stream frees every block;
admission errors are translated at the boundary."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sluice.backends.base import GenerationRequest
from sluice.backends.engine import EngineBackend
from sluice.engine.driver import AsyncEngine
from sluice.engine.engine import Engine, EngineConfig
from sluice.engine.models import GPT2Config, GPT2LMHeadModel
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.tokenizer import Tokenizer
from sluice.errors import BadRequestError, CapacityError
from sluice.events import Finished, FinishReason, NeutralEvent, Started, TextDelta, Usage
from sluice.streams import HubSettings, MemoryEventLog, StreamHub, StreamState
from tests.engine.tiny_models import varied_gpt2
from tests.streams.reading import read_until, read_until_done
from tests.tiny_tokenizer import train_tokenizer

pytestmark = pytest.mark.anyio

CORPUS = ["The quick brown fox jumps over the lazy dog.", "Streams of tokens, café 東京 🙂."] * 20
PROMPT = "The quick brown fox"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@dataclass(frozen=True)
class Setup:
    model: GPT2LMHeadModel
    tokenizer: Tokenizer


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    path: Path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_tokenizer(path, CORPUS)
    tokenizer = Tokenizer.from_file(path)
    config = GPT2Config(
        vocab_size=tokenizer.vocab_size, n_positions=128, n_embd=32, n_layer=2, n_head=4
    )
    return Setup(varied_gpt2(config), tokenizer)


def make_engine(setup: Setup, *, max_waiting: int = 16) -> Engine:
    config = EngineConfig(
        num_blocks=32,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_waiting=max_waiting,
        max_model_len=128,
    )
    return Engine(
        setup.model,
        config,
        eos_token_id=None,  # a random model: stop is tested with stop_token_ids
        token_bytes=setup.tokenizer.token_bytes,
    )


def greedy_tokens(setup: Setup, num_tokens: int) -> list[int]:
    engine = make_engine(setup)
    engine.add_request(setup.tokenizer.encode(PROMPT), SamplingParams(num_tokens, temperature=0))
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        tokens.extend(t for output in engine.step() for t in output.new_token_ids)
    return tokens


@dataclass
class Running:
    hub: StreamHub
    driver: AsyncEngine


@pytest.fixture
def params() -> SamplingParams:
    return SamplingParams(temperature=0)


@pytest.fixture
async def running(setup: Setup, params: SamplingParams) -> AsyncIterator[Running]:
    async with AsyncEngine(make_engine(setup)) as driver:
        backend = EngineBackend(
            "tiny", driver, setup.tokenizer, default_max_tokens=8, params=params
        )
        settings = HubSettings(default_grace_s=5.0, retention_s=30.0, max_streams=10)
        hub = StreamHub(MemoryEventLog(), {"tiny": backend}, settings)
        async with hub.running():
            yield Running(hub, driver)


def text_events(events: list[NeutralEvent]) -> list[TextDelta]:
    return [e for e in events if isinstance(e, TextDelta)]


def text_of(events: list[NeutralEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


def expected_text(setup: Setup, tokens: list[int]) -> str:
    return b"".join(setup.tokenizer.token_bytes(t) for t in tokens).decode(errors="replace")


async def test_stream_ends_with_usage_and_length(setup: Setup, running: Running) -> None:
    stream = await running.hub.create("tiny", GenerationRequest(PROMPT, max_tokens=6))
    events = await read_until_done(running.hub.open_reader(stream.id, 0))
    num_prompt = len(setup.tokenizer.encode(PROMPT))
    assert isinstance(events[0], Started)
    assert events[-2:] == [Usage(num_prompt, 6, 0), Finished(FinishReason.LENGTH)]
    assert text_of(events) == expected_text(setup, greedy_tokens(setup, 6))
    assert stream.state is StreamState.FINISHED


@pytest.mark.parametrize("stop_index", [2])
async def test_stream_ends_with_stop_on_a_stop_token(setup: Setup, stop_index: int) -> None:
    tokens = greedy_tokens(setup, 8)
    stop_token = tokens[stop_index]
    first = tokens.index(stop_token)  # the first time greedy decoding meets it
    params = SamplingParams(temperature=0, stop_token_ids=[stop_token])
    async with AsyncEngine(make_engine(setup)) as driver:
        backend = EngineBackend(
            "tiny", driver, setup.tokenizer, default_max_tokens=8, params=params
        )
        hub = StreamHub(MemoryEventLog(), {"tiny": backend}, HubSettings(default_grace_s=5.0))
        async with hub.running():
            stream = await hub.create("tiny", GenerationRequest(PROMPT))
            events = await read_until_done(hub.open_reader(stream.id, 0))
    assert events[-1] == Finished(FinishReason.STOP)
    usage = events[-2]
    assert isinstance(usage, Usage)
    assert usage.completion_tokens == first + 1
    assert text_of(events) == expected_text(setup, tokens[:first])  # the stop token is not text


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=100)])
async def test_cancel_mid_stream_aborts_the_engine_request_and_frees_blocks(
    running: Running,
) -> None:
    initial = await running.driver.call(lambda engine: engine.block_manager_stats())
    stream = await running.hub.create("tiny", GenerationRequest(PROMPT, max_tokens=100))
    reader = running.hub.open_reader(stream.id, 0)
    events = await read_until(reader, lambda seen: len(text_events(seen)) >= 2)
    running.hub.cancel(stream.id)
    events += await read_until(reader, lambda seen: reader.done)
    assert events[-1] == Finished(FinishReason.CANCELLED)
    usage = events[-2]
    assert isinstance(usage, Usage)
    assert 2 <= usage.completion_tokens < 100
    after = await running.driver.call(lambda engine: engine.block_manager_stats())
    assert after.num_free_blocks == initial.num_free_blocks == after.num_blocks
    assert await running.driver.call(lambda engine: engine.num_requests) == 0


async def test_abort_returns_with_the_blocks_free_and_reports_how_long_that_took(
    setup: Setup, params: SamplingParams
) -> None:
    """A cancel mid-stream waits for the engine thread to apply the abort: by the terminal
    event the observer was told the time, once, and the blocks are free."""
    freed_after_s: list[float] = []
    async with AsyncEngine(make_engine(setup)) as driver:
        backend = EngineBackend(
            "tiny", driver, setup.tokenizer, default_max_tokens=100, params=params
        )
        backend.set_abort_observer(freed_after_s.append)
        hub = StreamHub(MemoryEventLog(), {"tiny": backend}, HubSettings(default_grace_s=5.0))
        async with hub.running():
            stream = await hub.create("tiny", GenerationRequest(PROMPT, max_tokens=100))
            reader = hub.open_reader(stream.id, 0)
            await read_until(reader, lambda seen: len(text_events(seen)) >= 2)
            hub.cancel(stream.id)
            events = await read_until(reader, lambda seen: reader.done)
            assert events[-1] == Finished(FinishReason.CANCELLED)
            assert len(freed_after_s) == 1
            assert 0 <= freed_after_s[0] < 10
            stats = await driver.call(lambda engine: engine.block_manager_stats())
            assert stats.num_free_blocks == stats.num_blocks


async def test_admission_errors_are_translated(setup: Setup) -> None:
    async with AsyncEngine(make_engine(setup, max_waiting=1)) as driver:
        backend = EngineBackend("tiny", driver, setup.tokenizer, default_max_tokens=4)
        with pytest.raises(BadRequestError):
            [d async for d in backend.generate(GenerationRequest(""))]
        with pytest.raises(BadRequestError):
            [d async for d in backend.generate(GenerationRequest(PROMPT, max_tokens=0))]
        with pytest.raises(BadRequestError):  # prompt + max_tokens > max_model_len
            [d async for d in backend.generate(GenerationRequest(PROMPT, max_tokens=500))]
        # Hold the engine thread so both adds are handled before any step admits one.
        gate = threading.Event()
        held = asyncio.ensure_future(driver.call(lambda engine: gate.wait(5)))
        first = backend.generate(GenerationRequest(PROMPT))
        second = backend.generate(GenerationRequest(PROMPT))
        first_iter, second_iter = aiter(first), aiter(second)
        first_task = asyncio.ensure_future(anext(first_iter))
        second_task = asyncio.ensure_future(anext(second_iter))
        await asyncio.sleep(0)  # all three commands are queued
        gate.set()
        assert await held
        await first_task
        with pytest.raises(CapacityError) as excinfo:
            await second_task
        assert excinfo.value.retry_after_s == 1
        await first.abort()
        await first.abort()  # idempotent
        await second.abort()
        await backend.generate(GenerationRequest(PROMPT)).abort()  # before the start
        stats = await driver.call(lambda engine: engine.block_manager_stats())
        assert stats.num_free_blocks == stats.num_blocks
        await first_iter.aclose()  # type: ignore[attr-defined]


async def test_request_predicted_over_the_ttft_slo_is_refused_before_it_is_queued(
    setup: Setup,
) -> None:
    """make_engine runs 4 sequences: a fifth waits for the first of them to end."""
    async with AsyncEngine(make_engine(setup)) as driver:
        backend = EngineBackend(
            "tiny", driver, setup.tokenizer, default_max_tokens=4, ttft_slo_s=0.5
        )
        backend.step_cost.coefficients = (0.1, 0.0, 0.0, 0.0)  # as if measured: 0.1 s a step
        for key in range(4):  # four decoding, the first ends in 10 steps
            backend.predictor.queued(key, 8, 10 + key, now=0.0)
            backend.predictor.generated(key, 1, produced_at=0.0, now=0.0)
        refused = backend.generate(GenerationRequest(PROMPT))
        with pytest.raises(CapacityError) as excinfo:
            await refused.start()
        assert excinfo.value.reason == "ttft_slo"
        assert excinfo.value.retry_after_s >= 0.5
        assert await driver.call(lambda engine: engine.num_requests) == 0
        backend.predictor.left(0)  # a slot is free: one step to the first token
        admitted = backend.generate(GenerationRequest(PROMPT))
        await admitted.start()
        assert backend.predictor.num_queued_tokens == len(setup.tokenizer.encode(PROMPT))
        await admitted.abort()
        assert backend.predictor.num_queued_tokens == 0


async def test_predictor_follows_the_engine_and_forgets_every_ended_request(
    setup: Setup,
) -> None:
    """Finished, cancelled-while-queued and cancelled-mid-decode requests all leave the
    predictor; the engine's steps (at least ten) fit its step cost."""
    async with AsyncEngine(make_engine(setup)) as driver:
        backend = EngineBackend("tiny", driver, setup.tokenizer, default_max_tokens=4)
        hub = StreamHub(MemoryEventLog(), {"tiny": backend}, HubSettings(default_grace_s=5.0))
        async with hub.running():
            streams = [
                await hub.create("tiny", GenerationRequest(PROMPT, max_tokens=n))
                for n in (9, 10, 50, 50, 50, 50, 50)
            ]
            hub.cancel(streams[-1].id)  # very likely still queued
            for stream in streams[:2]:
                await read_until_done(hub.open_reader(stream.id, 0))
            reader = hub.open_reader(streams[2].id, 0)
            await read_until(reader, lambda seen: len(text_events(seen)) >= 1)
            for stream in streams[2:]:
                hub.cancel(stream.id)
            for stream in streams[2:]:
                await read_until_done(hub.open_reader(stream.id, 0))
        assert backend.predictor.num_queued_tokens == 0
        assert backend.predictor.predict_s(4, 4, limit_s=10.0) is not None
        assert backend.step_cost.coefficients is not None
        assert min(backend.step_cost.coefficients) >= 0
        stats = await driver.call(lambda engine: engine.block_manager_stats())
        assert stats.num_free_blocks == stats.num_blocks
