"""AsyncEngine: the engine's steps on one thread, outputs streamed to the event loop.

Concurrent streams give the engine's own greedy tokens, an abort frees every block, the
loop keeps running during steps, admission errors and step errors reach the right caller,
and stopping ends live streams and joins the thread. Nothing leaks when a stream is
aborted or cancelled: the tests say so by counting free blocks.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import pytest

from sluice.engine import BlockManagerStats, QueueFullError
from sluice.engine.driver import (
    STEP_FAILED_MESSAGE,
    AsyncEngine,
    EngineClosedError,
    EngineRequestError,
    EngineStepError,
    RequestStream,
)
from sluice.engine.engine import Engine, EngineConfig, RequestOutput
from sluice.engine.models import GPT2Config, GPT2LMHeadModel
from sluice.engine.sampling_params import SamplingParams
from tests.engine.tiny_models import ascii_bytes, nan_at_position, varied_gpt2

pytestmark = pytest.mark.anyio

MODEL_CONFIG = GPT2Config(vocab_size=101, n_positions=256, n_embd=64, n_layer=2, n_head=4)
GREEDY = SamplingParams(max_tokens=12, temperature=0)
LONG = SamplingParams(max_tokens=100, temperature=0)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def model() -> GPT2LMHeadModel:
    return varied_gpt2(MODEL_CONFIG)


def make_engine(model: GPT2LMHeadModel, *, max_waiting: int = 64) -> Engine:
    config = EngineConfig(
        num_blocks=64,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_waiting=max_waiting,
        max_model_len=128,
    )
    return Engine(model, config, eos_token_id=None, token_bytes=ascii_bytes)


@pytest.fixture
async def driver(model: GPT2LMHeadModel) -> AsyncIterator[AsyncEngine]:
    async with AsyncEngine(make_engine(model)) as driver:
        yield driver


def run_sync(model: GPT2LMHeadModel, prompts: list[list[int]]) -> list[list[int]]:
    engine = make_engine(model)
    ids = [engine.add_request(prompt, GREEDY) for prompt in prompts]
    tokens: dict[int, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id].extend(output.new_token_ids)
    return [tokens[i] for i in ids]


async def collect(stream: RequestStream, timeout_s: float = 10.0) -> list[RequestOutput]:
    async with asyncio.timeout(timeout_s):
        return [output async for output in stream]


async def stats(driver: AsyncEngine) -> BlockManagerStats:
    return await driver.call(lambda engine: engine.block_manager_stats())


def engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "sluice-engine"]


async def test_concurrent_streams_match_the_engine_run_synchronously(
    model: GPT2LMHeadModel, driver: AsyncEngine
) -> None:
    prompts = [[1, 2, 3, 4, 5], [7, 99, 3, 14, 15, 92, 65]]
    streams = [await driver.add_request(prompt, GREEDY) for prompt in prompts]
    results = await asyncio.gather(*(collect(stream) for stream in streams))
    tokens = [[t for output in outputs for t in output.new_token_ids] for outputs in results]
    assert tokens == run_sync(model, prompts)
    for outputs in results:
        assert [o.finished for o in outputs] == [False] * 11 + [True]
        assert outputs[-1].finish_reason == "length"
    assert len(set(tokens[0])) > 1  # the weights make greedy output vary


async def test_abort_mid_stream_ends_the_stream_and_frees_every_block(
    driver: AsyncEngine,
) -> None:
    initial = await stats(driver)
    stream = await driver.add_request([1, 2, 3, 4, 5, 6, 7, 8, 9], LONG)
    other = await driver.add_request([4, 5, 6], LONG)
    first = await anext(stream)
    assert not first.finished
    assert await driver.abort(stream.request_id)
    rest = await collect(stream)
    assert all(not o.finished for o in rest)  # ended by the abort, not by finishing
    assert not await driver.abort(stream.request_id)  # idempotent: already gone
    driver.abort_nowait(other.request_id)
    await collect(other)
    after = await stats(driver)
    assert after.num_free_blocks == initial.num_free_blocks == after.num_blocks
    assert await driver.call(lambda engine: engine.num_requests) == 0


async def test_take_ready_hands_over_what_piled_up_and_leaves_the_end(
    driver: AsyncEngine,
) -> None:
    finished = await driver.add_request([1, 2, 3], GREEDY)
    marker = await driver.add_request([7, 8, 9], GREEDY)  # runs in the same steps
    aborted = await driver.add_request([4, 5, 6], LONG)
    await collect(marker)
    # A step's outputs reach their streams together: all twelve of the first are there.
    ready = finished.take_ready()
    assert [o.num_completion_tokens for o in ready] == list(range(1, 13))
    assert ready[-1].finished
    assert finished.take_ready() == []
    with pytest.raises(StopAsyncIteration):
        await anext(finished)
    assert await driver.abort(aborted.request_id)
    await driver.call(lambda engine: None)  # the end is queued behind the outputs
    rest = aborted.take_ready()
    assert all(not o.finished for o in rest)
    assert aborted.take_ready() == []  # the end stays for anext
    with pytest.raises(StopAsyncIteration):
        await anext(aborted)


class _AbortClock(Engine):
    """The engine, noting how many steps had ended when each abort was applied."""

    aborted_at_step: dict[int, int]

    def abort(self, request_id: int) -> bool:
        self.aborted_at_step[request_id] = self.num_steps
        return super().abort(request_id)


async def test_abort_frees_the_blocks_by_the_end_of_the_step_in_progress(
    model: GPT2LMHeadModel,
) -> None:
    """Aborts sent at random moments of a busy engine are applied before the next step
    starts: at most one step (the one in progress) ends between sending and freeing."""
    config = make_engine(model).config
    engine = _AbortClock(model, config, eos_token_id=None, token_bytes=ascii_bytes)
    engine.aborted_at_step = {}
    async with AsyncEngine(engine) as driver:
        streams = [await driver.add_request([i + 1] * (5 + i), LONG) for i in range(8)]
        for stream in streams:
            await anext(stream)  # every request is decoding
        for stream in streams:
            await asyncio.sleep(0.001 * (stream.request_id % 3))  # vary the phase
            steps_sent = engine.num_steps  # an int read: the step in progress is not counted
            assert await driver.abort(stream.request_id)
            assert engine.aborted_at_step[stream.request_id] - steps_sent <= 1
            assert not await driver.abort(stream.request_id)  # gone, blocks with it
            await collect(stream)
        assert (await stats(driver)).num_used_blocks == 0


async def test_event_loop_keeps_running_while_the_engine_steps(model: GPT2LMHeadModel) -> None:
    """The loop runs callbacks while a step runs: a step hands the loop a callback and
    waits, inside the step, until the loop has run it. A loop blocked by the steps (a step
    run on the loop's thread, or one that never lets go of it) could never answer. (Counts
    of loop ticks inside steps were flaky on a busy 2-core machine; this handshake is
    not.)"""
    engine = make_engine(model)
    loop = asyncio.get_running_loop()
    step = engine.step
    answered: list[bool] = []

    def step_that_asks_the_loop() -> list[RequestOutput]:
        outputs = step()
        if len(answered) < 3 and (not answered or answered[-1]):
            ran = threading.Event()
            loop.call_soon_threadsafe(ran.set)
            answered.append(ran.wait(5.0))  # still inside the step
        return outputs

    engine.step = step_that_asks_the_loop  # type: ignore[method-assign]
    async with AsyncEngine(engine) as driver:
        streams = [await driver.add_request([i + 1, i + 2, i + 3], LONG) for i in range(4)]
        results = await asyncio.gather(*(collect(stream) for stream in streams))
    assert answered == [True, True, True]
    assert all(outputs[-1].finished for outputs in results)


async def test_queue_full_error_is_raised_by_add_request(model: GPT2LMHeadModel) -> None:
    gate = threading.Event()
    async with AsyncEngine(make_engine(model, max_waiting=1)) as driver:
        # Hold the engine thread so both adds are handled before any step admits one.
        held = asyncio.ensure_future(driver.call(lambda engine: gate.wait(5)))
        first = asyncio.ensure_future(driver.add_request([1, 2, 3], GREEDY))
        second = asyncio.ensure_future(driver.add_request([4, 5, 6], GREEDY))
        await asyncio.sleep(0)  # both add commands are queued behind the held call
        gate.set()
        assert await held
        stream = await first
        with pytest.raises(QueueFullError):
            await second
        assert (await collect(stream))[-1].finished
        with pytest.raises(ValueError, match="at least one token"):
            await driver.add_request([], GREEDY)


async def test_a_failing_step_fails_live_streams_and_the_thread_keeps_serving(
    driver: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    stream = await driver.add_request([1, 2, 3], LONG)
    await anext(stream)

    def install_failure(engine: Engine) -> None:
        real_step = engine.step

        def failing_step() -> list[RequestOutput]:
            monkeypatch.setattr(engine, "step", real_step)
            raise RuntimeError("boom")

        monkeypatch.setattr(engine, "step", failing_step)

    await driver.call(install_failure)
    with pytest.raises(EngineStepError) as excinfo:
        await collect(stream)
    assert isinstance(excinfo.value.__cause__, RuntimeError)
    assert str(excinfo.value) == STEP_FAILED_MESSAGE  # the cause is the log's, not the client's
    after = await collect(await driver.add_request([1, 2, 3], GREEDY))
    assert after[-1].finished
    final = await stats(driver)
    assert final.num_free_blocks == final.num_blocks


async def test_a_request_the_engine_fails_alone_ends_only_its_own_stream() -> None:
    """A request that reaches a NaN position embedding gets NaN logits: its stream ends
    with EngineRequestError while the streams beside it run to their last token."""
    model = nan_at_position(MODEL_CONFIG, 110)  # past the live ones' 2 + 100 tokens
    async with AsyncEngine(make_engine(model)) as driver:
        live = [await driver.add_request([i + 1, i + 2], LONG) for i in range(3)]
        for stream in live:
            await anext(stream)  # decoding now
        poisoned = await driver.add_request([i % 100 + 1 for i in range(112)], GREEDY)
        with pytest.raises(EngineRequestError, match="non-finite logits"):
            await collect(poisoned)
        for stream in live:
            rest = await collect(stream)
            assert rest[-1].finish_reason == "length"
            assert rest[-1].num_completion_tokens == LONG.max_tokens
        final = await stats(driver)
        assert final.num_free_blocks == final.num_blocks


async def test_cancelled_add_request_leaks_no_request(driver: AsyncEngine) -> None:
    task = asyncio.ensure_future(driver.add_request([1, 2, 3], LONG))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # Once a first call is handled, the add was too, and so its abort is queued: the
    # second call runs after the abort.
    await driver.call(lambda engine: None)
    assert await driver.call(lambda engine: engine.num_requests) == 0
    final = await stats(driver)
    assert final.num_free_blocks == final.num_blocks


async def test_stopping_ends_live_streams_and_joins_the_thread(model: GPT2LMHeadModel) -> None:
    async with AsyncEngine(make_engine(model)) as driver:
        assert driver.is_running
        streams = [await driver.add_request([i + 1, i + 2], LONG) for i in range(2)]
        for stream in streams:
            await anext(stream)
    assert not driver.is_running
    assert engine_threads() == []
    for stream in streams:
        with pytest.raises(EngineClosedError):
            await collect(stream)
    with pytest.raises(EngineClosedError):
        await driver.add_request([1], GREEDY)
    assert not await driver.abort(0)
    driver.abort_nowait(0)  # safe after the stop
