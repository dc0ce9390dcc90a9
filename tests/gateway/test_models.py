"""``GET /v1/models`` and ``GET /v1/models/{id}`` through the official ``openai`` SDK."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.server import ServerProcess


@pytest.fixture
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_listed_models_carry_created_and_each_can_be_retrieved(client: openai.OpenAI) -> None:
    models = list(client.models.list())
    assert [model.id for model in models] == ["sluice-tiny", "words"]
    for model in models:
        assert isinstance(model.created, int)
        assert 0 < model.created <= time.time()
        assert model.object == "model"
        assert client.models.retrieve(model.id) == model


def test_an_unknown_model_is_openais_404(client: openai.OpenAI, server: ServerProcess) -> None:
    with pytest.raises(openai.NotFoundError) as refused:
        client.models.retrieve("no-such-model")
    assert refused.value.code == "model_not_found"
    assert "no-such-model" in refused.value.message
    # Ids may hold slashes (upstream models such as org/name): one path segment or more.
    nested = httpx.get(f"{server.base_url}/v1/models/org/no-such-model")
    assert nested.status_code == 404
    assert nested.json()["error"]["code"] == "model_not_found"
