"""``sluice serve --draft-model``: a request's greedy text is the same with speculation and
opted out of it, and ``/readyz`` and ``/metrics`` show the drafts and their acceptance."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server import TEST_MODEL, ServerProcess

DRAFT_MODEL = TEST_MODEL.parent / "sluice-tiny-draft"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess("--draft-model", str(DRAFT_MODEL), "--num-speculative-tokens", "3") as s:
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
