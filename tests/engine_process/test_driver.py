"""The engine in a child process (``sluice serve --engine-process``), with real processes:
the same greedy tokens as in-process, an abort frees the KV blocks within a step, a dead
child fails its streams and is replaced, and a dead server takes its child with it."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from sluice.backends import engine as engine_backend
from sluice.engine.driver import EngineClosedError
from sluice.engine.loader import load_checkpoint
from sluice.engine.sampling_params import SamplingParams
from sluice.engine_process import EngineSpec, ProcessEngine, start_child
from sluice.errors import CapacityError
from tests.gateway.test_worker_backend import engine_stats, next_data, wait_for_stats
from tests.server import TEST_MODEL, ServerProcess

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

PROMPTS = ("Return the number of", "Create a new socket using the given address family")
START_TIMEOUT_S = 90.0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def spec(model: Path = TEST_MODEL) -> EngineSpec:
    return EngineSpec(
        model=model,
        name=None,
        device="cpu",
        dtype="auto",
        num_blocks=64,
        max_num_seqs=8,
        engine_threads=1,
    )


@pytest.fixture
async def driver() -> AsyncIterator[ProcessEngine]:
    child = await asyncio.to_thread(start_child, spec(), START_TIMEOUT_S)
    async with ProcessEngine(spec(), child) as engine:
        yield engine


def wait_exited(pid: int, timeout_s: float) -> bool:
    """Whether process ``pid`` (anyone's) exits within ``timeout_s``: a pidfd turns
    readable when it does."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        readable, _, _ = select.select([fd], [], [], timeout_s)
        return bool(readable)
    finally:
        os.close(fd)


async def tokens_of(driver: ProcessEngine, prompt: list[int], max_tokens: int) -> list[int]:
    stream = await driver.add_request(prompt, SamplingParams(max_tokens, temperature=0))
    return [token for output in [o async for o in stream] for token in output.new_token_ids]


async def test_streams_the_same_greedy_tokens_as_the_engine_in_this_process(
    driver: ProcessEngine,
) -> None:
    checkpoint = load_checkpoint(TEST_MODEL)
    prompts = [checkpoint.tokenizer.encode(text) for text in PROMPTS]
    engine = checkpoint.engine(num_blocks=64, max_num_seqs=8)
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(24, temperature=0))
    expected: dict[int, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            expected.setdefault(output.request_id, []).extend(output.new_token_ids)
    got = await asyncio.gather(*(tokens_of(driver, prompt, 24) for prompt in prompts))
    assert got == [expected[i] for i in sorted(expected)]
    assert driver.info.name == "sluice-tiny"
    assert driver.config.max_num_seqs == 8


async def test_abort_mid_stream_ends_it_with_the_blocks_free(driver: ProcessEngine) -> None:
    """Nothing leaks: when ``abort`` returns, the child's engine holds no block and no
    request, and the stream has ended."""
    stream = await driver.add_request([1, 2, 3, 4, 5], SamplingParams(200, temperature=0))
    outputs = [await anext(stream), await anext(stream)]
    assert not outputs[-1].finished
    assert await driver.abort(stream.request_id)
    rest = [output async for output in stream]
    assert all(not output.finished for output in rest)
    stats = await driver.call(engine_backend.engine_stats)
    assert stats["kv_blocks_used"] == 0
    assert stats["running"] == stats["waiting"] == 0


async def test_admission_errors_are_raised_by_add_request(driver: ProcessEngine) -> None:
    too_long = [1] * (driver.config.max_model_len + 1)
    with pytest.raises(ValueError, match=r"max_model_len|prompt"):
        await driver.add_request(too_long, SamplingParams(4))
    assert await tokens_of(driver, [1, 2, 3], 3)  # and the engine serves on


async def test_a_killed_child_fails_its_streams_and_another_takes_over(
    driver: ProcessEngine,
) -> None:
    stream = await driver.add_request([1, 2, 3], SamplingParams(200, temperature=0))
    await anext(stream)
    first_pid = driver.pid
    os.kill(first_pid, signal.SIGKILL)
    with pytest.raises(EngineClosedError, match="engine process"):
        async for _ in stream:
            pass
    # The new child is still loading (torch alone takes a second to import): a 503.
    with pytest.raises(CapacityError, match="starting again") as refused:
        await driver.add_request([1, 2, 3], SamplingParams(4))
    assert refused.value.retry_after_s > 0
    async with asyncio.timeout(START_TIMEOUT_S):
        await driver.wait_running()
    assert driver.pid != first_pid
    assert driver.num_restarts == 1
    assert len(await tokens_of(driver, [1, 2, 3], 5)) == 5
    assert wait_exited(first_pid, 0)


def test_a_model_that_does_not_load_is_refused_with_the_reason(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="missing-model"):
        start_child(spec(tmp_path / "missing-model"), START_TIMEOUT_S)


SERVER_SCRIPT = """
import sys, threading
from pathlib import Path
from sluice.errors import CapacityError
from sluice.engine_process import EngineSpec, start_child
spec = EngineSpec(Path(sys.argv[1]), None, "cpu", "auto", 64, 8, 1)
child = start_child(spec, 90.0)
print(child.process.pid, flush=True)
threading.Event().wait()
"""


def test_the_child_exits_when_its_server_is_killed() -> None:
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER_SCRIPT, str(TEST_MODEL)], stdout=subprocess.PIPE
    )
    try:
        assert server.stdout is not None
        child_pid = int(server.stdout.readline())
        assert not wait_exited(child_pid, 0)
        server.kill()
        server.wait(timeout=10)
        assert wait_exited(child_pid, 30)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        if server.stdout is not None:
            server.stdout.close()


def test_sluice_serve_engine_process_streams_the_in_process_text() -> None:
    body = {"prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    texts = []
    for flag in ("--engine-process", "--no-engine-process"):
        with ServerProcess("--model", str(TEST_MODEL), flag) as server:
            server.wait_ready()
            response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            texts.append(response.json()["choices"][0]["text"])
    assert texts[0] == texts[1]
    assert texts[0]


@pytest.mark.parametrize(
    "flags", [("--engine-process",), ("--engine-replicas", "2")], ids=["one", "replicas"]
)
def test_a_client_that_goes_away_frees_the_childs_kv_blocks(flags: tuple[str, ...]) -> None:
    body = {"prompt": PROMPTS[1], "max_tokens": 200, "ignore_eos": True, "stream": True}
    with ServerProcess("--model", str(TEST_MODEL), *flags) as server:
        server.wait_ready()
        with httpx.stream(
            "POST", f"{server.base_url}/v1/completions", json=body, timeout=30
        ) as response:
            assert response.status_code == 200
            lines = response.iter_lines()  # referenced: collecting it closes the response
            assert next_data(lines)
            busy = engine_stats(server, "sluice-tiny")
            assert busy["running"] + busy["waiting"] == 1, busy
            assert busy["kv_blocks_used"] > 0, busy
        # The connection closed mid-stream: the child's engine frees the blocks.
        wait_for_stats(server, "sluice-tiny", running=0, waiting=0, kv_blocks_used=0)
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=30).text
        freed = [
            line
            for line in metrics.splitlines()
            if line.startswith('sluice_cancel_to_kv_free_seconds_count{model="sluice-tiny"')
        ]
        assert freed
        assert float(freed[0].rpartition(" ")[2]) >= 1
