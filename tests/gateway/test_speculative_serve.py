"""``sluice serve --draft-model``: a request's greedy text is the same with speculation and
opted out of it, every dialect's ``"speculative": false`` opts out, and ``/readyz`` and
``/metrics`` show the drafts and their acceptance."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server import TEST_MODEL, ServerProcess

DRAFT_MODEL = TEST_MODEL.parent / "sluice-tiny-draft"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    # A fixed k: every request that may speculate does (adaptive k could choose 0).
    options = ("--num-speculative-tokens", "3", "--fixed-speculative-tokens")
    with ServerProcess("--draft-model", str(DRAFT_MODEL), *options) as s:
        yield s.wait_ready()


def complete(server: ServerProcess, **extra: object) -> str:
    body = {"prompt": "Return the", "max_tokens": 40, "temperature": 0, **extra}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    text: str = response.json()["choices"][0]["text"]
    return text


def test_greedy_text_is_the_same_with_speculation_and_opted_out(server: ServerProcess) -> None:
    speculated = complete(server)
    assert speculated
    assert complete(server, speculative=False) == speculated


CHAT = [{"role": "user", "content": "Return the"}]
# One body per dialect: the path and its request, all greedy and 24 tokens long.
DIALECT_BODIES = {
    "native": ("/v1/streams", {"prompt": "Return the", "max_tokens": 24}),
    "openai_completions": ("/v1/completions", {"prompt": "Return the", "max_tokens": 24}),
    "openai_chat": ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 24}),
    "openai_responses": ("/v1/responses", {"input": "Return the", "max_output_tokens": 24}),
    "anthropic": ("/v1/messages", {"messages": CHAT, "max_tokens": 24}),
    "vercel_ui": (
        "/v1/ui/chat",
        {
            "messages": [{"role": "user", "parts": [{"type": "text", "text": "Return the"}]}],
            "max_tokens": 24,
        },
    ),
}


def draft_tokens(server: ServerProcess) -> int:
    engine = httpx.get(f"{server.base_url}/readyz").json()["engines"]["sluice-tiny"]
    count: int = engine["spec_decode_draft_tokens"]
    return count


def run_to_the_end(server: ServerProcess, path: str, body: dict[str, object]) -> None:
    body = {**body, "temperature": 0, "ignore_eos": True}
    if path == "/v1/streams":
        created = httpx.post(f"{server.base_url}{path}", json=body, timeout=60)
        assert created.status_code == 201, created.text
        path = created.json()["events_url"]
        response = httpx.get(f"{server.base_url}{path}", timeout=60)
    else:
        response = httpx.post(f"{server.base_url}{path}", json=body, timeout=60)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("dialect", sorted(DIALECT_BODIES))
def test_every_dialect_opts_out_of_speculation_per_request(
    server: ServerProcess, dialect: str
) -> None:
    path, body = DIALECT_BODIES[dialect]
    before = draft_tokens(server)
    run_to_the_end(server, path, {**body, "speculative": False})
    assert draft_tokens(server) == before  # nothing drafted for it
    run_to_the_end(server, path, body)  # the control: the same request does draft
    assert draft_tokens(server) > before


def test_readyz_and_metrics_count_drafts_and_accepted_tokens(server: ServerProcess) -> None:
    complete(server)
    engine = httpx.get(f"{server.base_url}/readyz").json()["engines"]["sluice-tiny"]
    assert engine["spec_decode_draft_tokens"] > 0
    assert 0 <= engine["spec_decode_accepted_tokens"] <= engine["spec_decode_draft_tokens"]
    assert engine["spec_decode_draft_tokens_pos_1"] > 0
    assert engine["spec_decode_accepted_tokens_pos_1"] <= engine["spec_decode_draft_tokens_pos_1"]
    samples = {
        sample.name: sample.value
        for family in text_string_to_metric_families(httpx.get(f"{server.base_url}/metrics").text)
        for sample in family.samples
        if sample.labels.get("position", "0") == "0"
    }
    assert samples["vllm:spec_decode_num_draft_tokens_total"] == engine["spec_decode_draft_tokens"]
    assert "vllm:spec_decode_num_accepted_tokens_per_pos_total" in samples
