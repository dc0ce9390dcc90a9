"""One request cannot fail the engine's other requests, against real ``sluice serve``
processes with two tenants.

Tenant ``b`` runs four long generations; tenant ``a`` sends poisoned requests while they
decode: temperatures so small that dividing the logits by them overflowed (1e-300,
5e-324, 1e-38, on the native, OpenAI and Anthropic APIs), and, on a checkpoint with a NaN
position embedding, a request long enough to get NaN logits. The temperatures are greedy
(the same text as ``temperature: 0``); the NaN request fails alone with a message that
names no internals. Either way ``b``'s four generations run to their last token.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from sluice.cli import BUNDLED_MODEL
from sluice.engine.tokenizer import Tokenizer
from sluice.sse import Decoder, Event
from tests.server import ServerProcess

pytestmark = pytest.mark.anyio

KEY_A = "key-of-tenant-a-0123456789"
KEY_B = "key-of-tenant-b-0123456789"
LIVE_PROMPT = "The quick brown fox"
LIVE_MAX_TOKENS = 200  # ~1 s of decoding beside the poisons; 8 + 200 < the 256 of context
NAN_POSITION = 220  # the NaN checkpoint: past every live request's 208 positions
POISON_TEMPERATURES = [1e-300, 5e-324, 1e-38]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def serve(*options: str) -> ServerProcess:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SLUICE_API_KEYS", f"a:{KEY_A},b:{KEY_B}")
        return ServerProcess(*options).start()


@pytest.fixture(scope="module")
def bundled() -> Iterator[ServerProcess]:
    server = serve()
    try:
        yield server.wait_ready()
    finally:
        server.close()


@pytest.fixture(scope="module")
def nan_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled model with position embedding ``NAN_POSITION`` set to NaN (what a broken
    checkpoint or an overflow gives): a request reaching it gets NaN logits."""
    directory = tmp_path_factory.mktemp("nan") / "sluice-tiny-nan"
    shutil.copytree(BUNDLED_MODEL, directory)
    weights = load_file(str(directory / "model.safetensors"))
    weights["transformer.wpe.weight"][NAN_POSITION] = torch.nan
    save_file(weights, str(directory / "model.safetensors"))
    return directory


async def create(client: httpx.AsyncClient, key: str, **fields: object) -> str:
    response = await client.post("/v1/streams", json=fields, headers=bearer(key))
    assert response.status_code == 201, response.text
    events_url: str = response.json()["events_url"]
    return events_url


async def read_events(
    client: httpx.AsyncClient, events_url: str, on_token: asyncio.Event | None = None
) -> list[Event]:
    """Every event of a stream, up to its terminal one; ``on_token`` is set at the first
    token."""
    decoder = Decoder()
    events: list[Event] = []
    async with client.stream("GET", events_url, timeout=60) as response:
        assert response.status_code == 200
        async for chunk in response.aiter_bytes():
            events.extend(decoder.feed(chunk))
            if on_token is not None and any(e.event == "token" for e in events):
                on_token.set()
    return events


def text_of(events: list[Event]) -> str:
    return "".join(json.loads(e.data)["text"] for e in events if e.event == "token")


def assert_whole(events: list[Event]) -> None:
    """A live request's stream: every token it was asked for, then ``done: length``."""
    names = [e.event for e in events]
    assert "error" not in names, events[-1].data
    assert names[-2:] == ["usage", "done"]
    assert json.loads(events[-2].data)["completion_tokens"] == LIVE_MAX_TOKENS
    assert json.loads(events[-1].data) == {"reason": "length"}


async def beside_four_live_requests(
    server: ServerProcess, poison: Callable[[httpx.AsyncClient], Awaitable[None]]
) -> None:
    """Run ``poison`` (tenant a) while four tenant-b generations decode; then check that
    those four ran whole."""
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
        started = [asyncio.Event() for _ in range(4)]
        readers = []
        for on_token in started:
            url = await create(
                client, KEY_B, prompt=LIVE_PROMPT, max_tokens=LIVE_MAX_TOKENS, ignore_eos=True
            )
            readers.append(asyncio.create_task(read_events(client, url, on_token)))
        for on_token in started:
            await on_token.wait()
        await poison(client)
        # The poison ran while the four still decoded: otherwise this test proves nothing.
        assert not any(reader.done() for reader in readers), "live requests ended too soon"
        for reader in readers:
            assert_whole(await reader)


async def greedy_text(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> str:
    url = await create(client, KEY_A, prompt=prompt, max_tokens=max_tokens, temperature=0)
    return text_of(await read_events(client, url))


async def test_tiny_temperatures_are_greedy_and_fail_no_one(bundled: ServerProcess) -> None:
    prompt, max_tokens = "Streams of tokens", 8

    async def poison(client: httpx.AsyncClient) -> None:
        native = [
            create(client, KEY_A, prompt=prompt, max_tokens=max_tokens, temperature=t)
            for t in POISON_TEMPERATURES
        ]
        chat = client.post(
            "/v1/chat/completions",
            headers=bearer(KEY_A),
            json={
                "model": "sluice-tiny",
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens,
                "temperature": 1e-300,
            },
        )
        messages = client.post(
            "/v1/messages",
            headers={"x-api-key": KEY_A, "anthropic-version": "2023-06-01"},
            json={
                "model": "sluice-tiny",
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens,
                "temperature": 5e-324,
            },
        )
        urls = await asyncio.gather(*native)
        poisoned = await asyncio.gather(*(read_events(client, url) for url in urls))
        chat_response, messages_response = await asyncio.gather(chat, messages)
        assert chat_response.status_code == 200, chat_response.text
        assert messages_response.status_code == 200, messages_response.text
        expected = await greedy_text(client, prompt, max_tokens)
        for events in poisoned:
            assert [e.event for e in events][-1] == "done"
            assert text_of(events) == expected

    await beside_four_live_requests(bundled, poison)


async def test_a_request_with_nan_logits_fails_alone(nan_checkpoint: Path) -> None:
    server = serve("--model", str(nan_checkpoint))
    try:
        server.wait_ready()
        tokenizer = Tokenizer.from_file(nan_checkpoint / "tokenizer.json")
        long_prompt = " ".join(["socket"] * (NAN_POSITION + 10))
        assert NAN_POSITION < len(tokenizer.encode(long_prompt)) < 240

        async def poison(client: httpx.AsyncClient) -> None:
            url = await create(client, KEY_A, prompt=long_prompt, max_tokens=8, temperature=1)
            events = await read_events(client, url)
            assert [e.event for e in events][-1] == "error"
            error = json.loads(events[-1].data)
            assert error["message"] == "the model produced non-finite logits for this request"
            assert error["retryable"] is False

        await beside_four_live_requests(server, poison)
    finally:
        server.close()
