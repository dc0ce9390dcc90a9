"""Several engine processes as one (``sluice serve --engine-replicas N``), with real child
processes: requests spread over the replicas and stream each one's greedy tokens, ids stay
unique so that an abort reaches the right replica and frees its blocks, the stats add up;
the server with two replicas streams what it does with one (and frees a gone client's
blocks: ``test_driver.py``)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator

import httpx
import pytest

from sluice.backends import engine as engine_backend
from sluice.cli import _embedded_engine, build_parser
from sluice.engine.driver import EngineClosedError
from sluice.engine.sampling_params import SamplingParams
from sluice.engine_process import EngineReplicas, ProcessEngine, start_child
from sluice.engine_process.replicas import merge_stats
from sluice.errors import ConfigError
from tests.engine_process.test_driver import PROMPTS, START_TIMEOUT_S, spec, tokens_of
from tests.gateway.test_worker_backend import engine_stats
from tests.server import TEST_MODEL, ServerProcess

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def replicas() -> AsyncIterator[EngineReplicas]:
    children = await asyncio.gather(
        *(asyncio.to_thread(start_child, spec(), START_TIMEOUT_S) for _ in range(2))
    )
    async with EngineReplicas([ProcessEngine(spec(), child) for child in children]) as engines:
        yield engines


async def test_requests_spread_over_the_replicas_with_the_one_engines_tokens(
    replicas: EngineReplicas,
) -> None:
    single = replicas.replicas[0]
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]
    # Long enough that none ends before the last is added (200 steps of the child's).
    expected = [await tokens_of(single, prompt, 200) for prompt in prompts]
    params = SamplingParams(200, temperature=0)
    streams = [await replicas.add_request(prompt, params) for prompt in prompts]
    assert [replica.num_live for replica in replicas.replicas] == [2, 2]
    assert len({stream.request_id for stream in streams}) == 4
    assert sorted(stream.request_id % 2 for stream in streams) == [0, 0, 1, 1]
    got = [
        [token async for output in stream for token in output.new_token_ids] for stream in streams
    ]
    assert got == expected
    assert replicas.config.max_num_seqs == 16
    assert replicas.config.num_blocks == 128
    assert replicas.config.max_model_len == single.config.max_model_len


async def test_an_abort_reaches_the_requests_replica_and_frees_its_blocks(
    replicas: EngineReplicas,
) -> None:
    params = SamplingParams(200, temperature=0)
    streams = [await replicas.add_request([1, 2, 3, 4, 5], params) for _ in range(2)]
    for stream in streams:
        assert not (await anext(stream)).finished
    assert await replicas.abort(streams[1].request_id)
    assert all(not output.finished for output in [o async for o in streams[1]])
    stats = await replicas.call(engine_backend.engine_stats)
    assert stats["running"] + stats["waiting"] == 1  # the other one runs on
    assert await replicas.abort(streams[0].request_id)
    stats = await replicas.call(engine_backend.engine_stats)
    assert stats["kv_blocks_used"] == 0
    assert stats["kv_blocks"] == 128
    assert stats["threads"] == 2  # one each
    assert not await replicas.abort(streams[0].request_id)


async def test_a_replica_started_again_is_passed_over_while_another_runs(
    replicas: EngineReplicas,
) -> None:
    dead = replicas.replicas[0]
    stream = await replicas.add_request([1, 2, 3], SamplingParams(200, temperature=0))
    assert stream.request_id % 2 == 0  # the first in turn
    await anext(stream)
    os.kill(dead.pid, signal.SIGKILL)
    with pytest.raises(EngineClosedError, match="engine process"):
        async for _ in stream:
            pass
    assert not dead.is_running  # its new process is still loading the model
    for _ in range(3):
        other = await replicas.add_request([4, 5, 6], SamplingParams(2, temperature=0))
        assert other.request_id % 2 == 1
        assert len([output async for output in other]) >= 1


async def test_only_stats_are_merged(replicas: EngineReplicas) -> None:
    with pytest.raises(TypeError, match="stats"):
        await replicas.call(_num_running)


def _num_running(engine: object) -> int:
    return 0


def test_merged_stats_add_counts_and_average_rates() -> None:
    merged = merge_stats(
        [
            {"running": 3, "kv_blocks": 64, "spec_decode_acceptance_pct": 80, "spec_decode_k": 4},
            {"running": 1, "kv_blocks": 64, "spec_decode_acceptance_pct": 60, "spec_decode_k": 2},
        ]
    )
    assert merged == {
        "running": 4,
        "kv_blocks": 128,
        "spec_decode_acceptance_pct": 70,
        "spec_decode_k": 3,
    }


def test_sluice_serve_with_two_replicas_streams_the_one_engines_text() -> None:
    body = {"prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    texts = []
    for replicas in ("1", "2"):
        with ServerProcess("--model", str(TEST_MODEL), "--engine-replicas", replicas) as server:
            server.wait_ready()
            for _ in range(2):  # the second goes to the other replica
                response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
                assert response.status_code == 200, response.text
                texts.append(response.json()["choices"][0]["text"])
            if replicas == "2":
                stats = engine_stats(server, "sluice-tiny")
                assert stats["kv_blocks"] == 1024
                assert stats["threads"] == 2
    assert len(set(texts)) == 1
    assert texts[0]


@pytest.mark.parametrize(
    ("flags", "reason"),
    [
        (("--no-engine-process", "--engine-replicas", "2"), "needs --engine-process"),
        (("--engine-replicas", "3", "--max-running", "2"), "at least as many"),
    ],
)
def test_replicas_need_the_engine_process_and_a_share_each(
    flags: tuple[str, ...], reason: str
) -> None:
    args = build_parser().parse_args(["serve", "--model", str(TEST_MODEL), *flags])
    with pytest.raises(ConfigError, match=reason):
        _embedded_engine(args)
