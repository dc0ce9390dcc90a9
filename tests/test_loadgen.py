"""``sluice bench`` against a real ``sluice serve``, and against tiny scripted servers for
the replies a healthy Sluice never gives (503 + Retry-After, an in-band error, silence)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import io
import random
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest

from sluice.errors import ConfigError
from sluice.loadgen import Api, BenchConfig, Load, bench, build_prompt, main
from sluice.loadgen_report import (
    Outcome,
    Percentiles,
    Progress,
    RequestResult,
    percentile,
    summarize,
    write_plot,
)
from tests.server import ServerProcess

MAX_TOKENS = 8


def _bench(tmp_path: Path, *argv: str) -> tuple[int, dict[str, object]]:
    """Run ``sluice bench`` in-process with ``--json``; return its status and document."""
    path = tmp_path / "bench.json"
    status = main([*argv, "--json", str(path), "--no-progress"])
    return status, orjson.loads(path.read_bytes())


def _levels(document: dict[str, object]) -> list[dict[str, object]]:
    levels = document["levels"]
    assert isinstance(levels, list)
    return levels


def _assert_ordered(level: dict[str, object], name: str) -> None:
    figures = level[name]
    assert isinstance(figures, dict)
    assert figures["p50"] <= figures["p90"] <= figures["p99"], figures


@pytest.mark.parametrize("api", ["native", "openai-chat", "openai-completions"])
def test_bench_concurrency_sweep_counts_every_token(
    server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str], api: str
) -> None:
    """The ``words`` model echoes the prompt, so 16 words at max 8 tokens is 8 tokens each."""
    status, document = _bench(
        tmp_path,
        *("--url", server.base_url, "--api", api, "--model", "words"),
        *("--concurrency", "1,2", "--requests", "3", "--max-tokens", str(MAX_TOKENS)),
        *("--prompt-tokens", "16"),
    )
    assert status == 0
    levels = _levels(document)
    assert [(lv["load"], lv["level"]) for lv in levels] == [("concurrency", 1), ("concurrency", 2)]
    for level in levels:
        assert (level["num_requests"], level["num_ok"]) == (3, 3)
        assert (level["num_refused"], level["num_errors"]) == (0, 0)
        assert level["num_output_tokens"] == 3 * MAX_TOKENS
        assert level["output_tokens_per_s"] > 0
        for name in ("ttft_ms", "itl_ms", "e2e_ms"):
            _assert_ordered(level, name)
    table = capsys.readouterr().out
    assert "| c=1 | 3 | 3 | 0 | 0 |" in table
    assert "| c=2 | 3 | 3 | 0 | 0 |" in table


def test_bench_rate_run_on_the_model_counts_usage_tokens(
    server: ServerProcess, tmp_path: Path
) -> None:
    status, document = _bench(
        tmp_path,
        *("--url", f"{server.base_url}/v1", "--api", "openai-chat", "--model", "sluice-tiny"),
        *("--rate", "50", "--requests", "4", "--max-tokens", str(MAX_TOKENS)),
        *("--temperature", "0"),
    )
    assert status == 0
    [level] = _levels(document)
    assert (level["load"], level["level"], level["num_ok"]) == ("rate", 50, 4)
    assert 4 <= level["num_output_tokens"] <= 4 * MAX_TOKENS
    _assert_ordered(level, "ttft_ms")


def test_bench_duration_level_ends_and_keeps_every_result(
    server: ServerProcess, tmp_path: Path
) -> None:
    status, document = _bench(
        tmp_path,
        *("--url", server.base_url, "--api", "native", "--model", "words"),
        *("--concurrency", "2", "--duration", "0.2", "--max-tokens", "2"),
    )
    assert status == 0
    [level] = _levels(document)
    assert level["num_requests"] >= 1
    assert level["num_ok"] == level["num_requests"]


@pytest.mark.parametrize("api", ["native", "openai-chat"])
def test_bench_unknown_model_is_an_error_not_a_refusal(
    server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str], api: str
) -> None:
    status, document = _bench(
        tmp_path,
        *("--url", server.base_url, "--api", api, "--model", "no-such-model"),
        *(
            "--requests",
            "2",
        ),
    )
    assert status == 1  # nothing succeeded
    [level] = _levels(document)
    assert (level["num_ok"], level["num_refused"], level["num_errors"]) == (0, 0, 2)
    assert level["errors"] == {"http 404 model_not_found": 2}
    assert level["ttft_ms"] == {"p50": None, "p90": None, "p99": None}
    assert "http 404 model_not_found x2" in capsys.readouterr().out


@contextlib.asynccontextmanager
async def _scripted_server(
    seen: list[str] | None = None, **replies: bytes | None
) -> AsyncIterator[str]:
    """An HTTP/1.1 server on 127.0.0.1 that reads one request per connection and answers
    with the reply given for its method (then closes), or for ``None`` says nothing until
    the client hangs up; a method with no reply gets a 404. ``seen`` collects the methods
    in the order they came."""
    not_found = _http("404 Not Found", b"{}")

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            method = head.split(b" ", 1)[0].decode()
            if seen is not None:
                seen.append(method)
            reply = replies.get(method, not_found)
            for line in head.split(b"\r\n"):
                name, _, value = line.partition(b":")
                if name.lower() == b"content-length":
                    await reader.readexactly(int(value))
            if reply is None:
                await reader.read()  # EOF: the client gave up
            else:
                writer.write(reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    listener = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    async with listener:
        yield f"http://127.0.0.1:{port}"


def _http(status: str, body: bytes, *headers: str) -> bytes:
    lines = [f"HTTP/1.1 {status}", *headers, f"Content-Length: {len(body)}", "Connection: close"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def _config(base_url: str, api: Api, *, timeout_s: float = 10.0) -> BenchConfig:
    return BenchConfig(
        base_url,
        api,
        Load.CONCURRENCY,
        (2,),
        num_requests=3,
        max_tokens=4,
        timeout_s=timeout_s,
        honor_retry_after=False,  # these count replies; pacing has its own test
    )


@pytest.mark.parametrize("api", [Api.NATIVE, Api.OPENAI_CHAT, Api.OPENAI_COMPLETIONS])
def test_bench_counts_503_with_retry_after_as_refused(api: Api) -> None:
    reply = _http("503 Service Unavailable", b'{"error": "full"}', "Retry-After: 7")

    async def scenario() -> None:
        async with _scripted_server(POST=reply) as url:
            [report] = await bench(_config(url, api))
        assert (report.num_refused, report.num_errors, report.num_ok) == (3, 0, 0)
        assert report.max_retry_after_s == 7
        assert report.errors == {}

    asyncio.run(scenario())


def test_closed_loop_workers_connect_before_the_first_request() -> None:
    """Two workers: each opens its connection (a GET) before any request is timed."""
    seen: list[str] = []
    reply = _http("503 Service Unavailable", b'{"error": "full"}', "Retry-After: 7")

    async def scenario() -> None:
        async with _scripted_server(seen, POST=reply) as url:
            [report] = await bench(_config(url, Api.OPENAI_CHAT))
        assert report.num_refused == 3

    asyncio.run(scenario())
    assert seen == ["GET", "GET", "POST", "POST", "POST"]


@pytest.mark.parametrize("honor", [True, False])
def test_closed_loop_worker_waits_the_retry_after_it_was_given(honor: bool) -> None:
    """One worker for 1.5 s against a server that always refuses with Retry-After: 1: it
    sends again only after a second or more (twice in all), or, told to ignore the hint,
    at once."""
    reply = _http("503 Service Unavailable", b'{"error": "full"}', "Retry-After: 1")
    config = BenchConfig(
        "http://127.0.0.1",
        Api.OPENAI_COMPLETIONS,
        Load.CONCURRENCY,
        (1,),
        num_requests=None,
        duration_s=1.5,
        honor_retry_after=honor,
    )

    async def scenario() -> None:
        async with _scripted_server(POST=reply) as url:
            [report] = await bench(dataclasses.replace(config, base_url=url))
        assert report.num_ok == report.num_errors == 0
        if honor:
            assert 1 <= report.num_refused <= 2
        else:
            assert report.num_refused >= 5

    asyncio.run(scenario())


def test_bench_counts_in_band_error_after_a_token_as_error() -> None:
    stream = (
        b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n'
        b'data: {"error": {"code": "backend_error", "message": "boom"}}\n\n'
    )
    reply = _http("200 OK", stream, "Content-Type: text/event-stream")

    async def scenario() -> None:
        async with _scripted_server(POST=reply) as url:
            [report] = await bench(_config(url, Api.OPENAI_CHAT))
        assert (report.num_errors, report.num_ok) == (3, 0)
        assert report.errors == {"in-band backend_error": 3}
        assert report.num_output_tokens == 3  # the token before the error still counts
        assert report.ttft_ms.p50 is not None

    asyncio.run(scenario())


def test_bench_counts_native_stream_cut_before_done_as_error() -> None:
    created = _http("201 Created", b'{"events_url": "/v1/streams/x/events"}')
    cut = _http("200 OK", b'event: token\ndata: {"text": "a"}\n\n')

    async def scenario() -> None:
        async with _scripted_server(POST=created, GET=cut) as url:
            [report] = await bench(_config(url, Api.NATIVE))
        assert report.errors == {"stream ended without a terminal event": 3}
        assert report.num_output_tokens == 3

    asyncio.run(scenario())


def test_bench_times_out_a_silent_server() -> None:
    async def scenario() -> None:
        async with _scripted_server(POST=None) as url:
            [report] = await bench(_config(url, Api.OPENAI_CHAT, timeout_s=0.2))
        assert report.errors == {"timeout": 3}

    asyncio.run(scenario())


def test_cancelling_bench_midway_closes_every_connection() -> None:
    """Cancel while both workers wait on a silent server: each connection is hung up."""

    async def scenario() -> None:
        arrived, num_open = asyncio.Event(), 0
        all_closed = asyncio.Event()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal num_open
            num_open += 1
            try:
                await reader.readuntil(b"\r\n\r\n")
                if num_open == 2:
                    arrived.set()
                await reader.read()  # until EOF: the client hung up
            finally:
                writer.close()
                num_open -= 1
                if num_open == 0:
                    all_closed.set()

        listener = await asyncio.start_server(handle, "127.0.0.1", 0)
        async with listener:
            url = f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}"
            task = asyncio.create_task(bench(_config(url, Api.OPENAI_CHAT)))
            await asyncio.wait_for(arrived.wait(), 10)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.wait_for(all_closed.wait(), 10)

    asyncio.run(scenario())


def test_bench_refuses_impossible_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--concurrency", "1.5", "--no-progress"]) == 2
    assert "whole numbers" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="exactly one"):
        BenchConfig("http://x", Api.NATIVE, Load.RATE, (1,), num_requests=None)
    with pytest.raises(ConfigError, match="http"):
        BenchConfig("ftp://x", Api.NATIVE, Load.RATE, (1,))


def test_build_prompt_is_deterministic_per_seed() -> None:
    first = build_prompt(random.Random(3), 20)
    assert first == build_prompt(random.Random(3), 20)
    assert len(first.split()) == 20
    assert first != build_prompt(random.Random(4), 20)


def test_percentile_interpolates_and_never_decreases() -> None:
    ordered = [1.0, 2.0, 3.0, 4.0]
    assert percentile(ordered, 0) == 1.0
    assert percentile(ordered, 50) == 2.5
    assert percentile(ordered, 100) == 4.0
    assert Percentiles.of_seconds([]) == Percentiles(None, None, None)
    with pytest.raises(ValueError, match="empty"):
        percentile([], 50)


def test_summarize_counts_outcomes_and_rates() -> None:
    results = [
        RequestResult(Outcome.OK, 1.0, ttft_s=0.1, itl_s=(0.01, 0.03), num_output_tokens=3),
        RequestResult(Outcome.REFUSED, 0.01, status=429, retry_after_s=2.0),
        RequestResult(Outcome.ERROR, 0.5, error="timeout"),
    ]
    report = summarize("rate", 5, results, wall_s=2.0)
    assert (report.num_ok, report.num_refused, report.num_errors) == (1, 1, 1)
    assert report.output_tokens_per_s == 1.5
    assert report.requests_per_s == 1.5
    assert report.itl_ms.p50 == pytest.approx(20.0)
    assert report.max_retry_after_s == 2.0
    assert report.errors == {"timeout": 1}


def test_progress_redraws_one_line_in_place() -> None:
    stream = io.StringIO()
    progress = Progress(stream, min_interval_s=0)
    progress.start("c=2", 2, None)
    progress.update(RequestResult(Outcome.OK, 0.1))
    progress.update(RequestResult(Outcome.ERROR, 0.1, error="timeout"))
    progress.finish()
    text = stream.getvalue()
    assert text.count("\n") == 1
    assert text.endswith("2/2 ok 1 refused 0 errors 1 " + text.rsplit(" ", 1)[-1])
    assert text.count("\r") >= 3


@pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is not None, reason="matplotlib is installed"
)
def test_plot_is_skipped_with_a_message_without_matplotlib(tmp_path: Path) -> None:
    path = tmp_path / "bench.png"
    report = summarize("concurrency", 1, [RequestResult(Outcome.OK, 0.1)], wall_s=0.1)
    assert "matplotlib is not installed" in write_plot([report], path)
    assert not path.exists()
