"""Sluice in upstream mode in front of a second Sluice in engine mode, both real processes:
the proxied stream equals the direct one token for token, a client that leaves aborts the
engine request on the far side (its KV blocks are freed), and an upstream that dies
mid-stream gives the client one clean in-band error and no success terminator."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import httpx
import openai
import orjson
import pytest

from sluice.sse import Decoder
from tests.server import ServerProcess

MESSAGES = [{"role": "user", "content": "What does the socket module provide?"}]


@pytest.fixture(scope="module")
def engine() -> Iterator[ServerProcess]:
    with ServerProcess("--kv-blocks", "128") as process:
        yield process.wait_ready()


@pytest.fixture(scope="module")
def proxy(engine: ServerProcess) -> Iterator[ServerProcess]:
    with ServerProcess("--upstream", f"{engine.base_url}/v1") as process:
        yield process.wait_ready()


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def deltas(server: ServerProcess, **fields: object) -> list[str]:
    stream = client(server).chat.completions.create(
        model="sluice-tiny",
        messages=MESSAGES,
        stream=True,
        **fields,  # type: ignore[call-overload]
    )
    return [c.choices[0].delta.content or "" for c in stream if c.choices]


def engine_stats(server: ServerProcess) -> dict[str, int]:
    stats: dict[str, int] = httpx.get(f"{server.base_url}/readyz").json()["engines"]["sluice-tiny"]
    return stats


def test_the_proxy_serves_the_upstreams_models(proxy: ServerProcess) -> None:
    listed = httpx.get(f"{proxy.base_url}/v1/models").json()
    assert [m["id"] for m in listed["data"]] == ["sluice-tiny", "words"]
    assert httpx.get(f"{proxy.base_url}/readyz").json()["engines"] == {}  # no engine here


def test_the_proxied_stream_equals_the_direct_one_token_for_token(
    engine: ServerProcess, proxy: ServerProcess
) -> None:
    fields = {"max_tokens": 24, "temperature": 0}
    direct = deltas(engine, **fields)
    assert "".join(direct).strip()
    assert deltas(proxy, **fields) == direct
    sampled = {"max_tokens": 24, "temperature": 0.9, "seed": 11}
    assert deltas(proxy, **sampled) == deltas(engine, **sampled)

    # The native API in front of the proxy: same tokens, and resumable as ever.
    created = httpx.post(
        f"{proxy.base_url}/v1/streams",
        # ignore_eos: the bundled model may end a text early; the proxy passes it on
        json={
            "prompt": "What does the socket module provide?",
            "max_tokens": 8,
            "ignore_eos": True,
        },
    ).json()
    raw = httpx.get(f"{proxy.base_url}{created['events_url']}", timeout=30).content
    events = Decoder().feed(raw)
    assert events[-1].event == "done"
    usage = orjson.loads(events[-2].data)
    assert usage["completion_tokens"] == 8
    assert usage["prompt_tokens"] > 0


def _wait_engine_idle(engine: ServerProcess) -> dict[str, int]:
    deadline = time.monotonic() + 10
    stats = engine_stats(engine)
    while time.monotonic() < deadline:
        stats = engine_stats(engine)
        if stats["running"] == stats["waiting"] == stats["kv_blocks_used"] == 0:
            return stats
        time.sleep(0.02)  # polling an observable condition with a deadline
    raise AssertionError(f"the engine still holds the request: {stats}")


def test_a_client_leaving_the_proxy_aborts_the_engine_request(
    engine: ServerProcess, proxy: ServerProcess
) -> None:
    with client(proxy).chat.completions.with_streaming_response.create(
        model="sluice-tiny",
        messages=MESSAGES,
        stream=True,
        max_tokens=200,
        extra_body={"ignore_eos": True},  # still running after 3 chunks, wherever EOS falls
    ) as response:
        for _, _chunk in zip(range(3), response.parse(), strict=False):
            pass
        busy = engine_stats(engine)
        assert busy["running"] == 1
        assert busy["kv_blocks_used"] > 0
    idle = _wait_engine_idle(engine)
    assert idle["kv_blocks_used"] == 0


def test_an_upstream_dying_mid_stream_is_one_clean_in_band_error() -> None:
    with ServerProcess("--kv-blocks", "128") as upstream:
        upstream.wait_ready()
        with ServerProcess("--upstream", f"{upstream.base_url}/v1") as proxy:
            proxy.wait_ready()
            body = {
                "model": "sluice-tiny",
                "messages": MESSAGES,
                "max_tokens": 230,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            with httpx.stream(
                "POST", f"{proxy.base_url}/v1/chat/completions", json=body, timeout=30
            ) as response:
                assert response.status_code == 200
                decoder = Decoder()
                events = []
                killed = False
                for piece in response.iter_raw():
                    events += decoder.feed(piece)
                    if not killed and len(events) >= 3:
                        assert upstream.process is not None
                        upstream.process.send_signal(signal.SIGKILL)
                        killed = True
    datas = [e.data for e in events]
    assert "[DONE]" not in datas
    last = orjson.loads(datas[-1])
    assert set(last) == {"error"}
    assert "upstream" in last["error"]["message"]
    assert all("error" not in orjson.loads(d) for d in datas[:-1])


def test_tools_reach_the_far_engine_which_refuses_them_naming_the_field(
    proxy: ServerProcess,
) -> None:
    """The proxy sends tools on; the engine behind it cannot call them, and its 400 comes
    back through the proxy as the client's own 400, naming the field."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.BadRequestError) as raised:
        client(proxy).chat.completions.create(
            model="sluice-tiny",
            messages=MESSAGES,  # type: ignore[arg-type]
            tools=tools,  # type: ignore[arg-type]
            stream=True,
        )
    assert "tools: this model cannot call tools" in str(raised.value)
