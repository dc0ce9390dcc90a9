"""Fuzzing the HTTP API from its own ``/openapi.json`` (schemathesis): no input gets a 5xx,
and every answer is one the description promises (status, media type, headers, body).

The server is a real ``sluice serve --no-model`` process (only ``words``, no engine), so
each request is cheap. Streams cannot hang a case: ``--max-stream-duration 1`` ends any
stream (a demo at ``interval_ms=60000`` included) within a second, and every request has
a timeout.

schemathesis' own pytest integration (``from_fixture(...).parametrize()``) sets
``node._nodeid``, which pytest 9 no longer has, so each operation is a plain parametrized
test that runs the operation's Hypothesis strategy (``as_strategy``).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation.case import Case
from schemathesis.generation.modes import GenerationMode
from schemathesis.openapi import from_url
from schemathesis.schemas import BaseSchema
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from sluice.gateway.openapi import openapi_document
from tests.server import ServerProcess

# Per operation and mode: 30 runs of at most 25 requests each, about half a minute in all.
MAX_EXAMPLES = 25
REQUEST_TIMEOUT_S = 10.0
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


@pytest.fixture(scope="module")
def fuzzed_server() -> Iterator[ServerProcess]:
    server = ServerProcess("--no-model", "--max-stream-duration", "1", "--grace", "1")
    with server:
        yield server.wait_ready()


@pytest.fixture(scope="module")
def api_schema(fuzzed_server: ServerProcess) -> BaseSchema:
    return from_url(f"{fuzzed_server.base_url}/openapi.json", timeout=REQUEST_TIMEOUT_S)


@pytest.fixture(scope="module")
def known_stream_id(fuzzed_server: ServerProcess) -> str:
    """A finished stream of the fuzzer's (anonymous) tenant, so lookups get past 404."""
    body = {"prompt": "one two three", "interval_ms": 0}
    response = httpx.post(f"{fuzzed_server.base_url}/v1/streams", json=body)
    assert response.status_code == 201, response.text
    stream_id: str = response.json()["id"]
    return stream_id


def _can_be_invalid(operation: dict[str, object]) -> bool:
    """Whether some input of ``operation`` can break its schema (any string is a valid
    model id, so ``GET /v1/models/{model_id}`` has no invalid input to generate)."""
    if "requestBody" in operation:
        return True
    parameters: list[dict[str, dict[str, object]]] = operation.get("parameters", [])  # type: ignore[assignment]
    return any(set(parameter["schema"]) - {"type"} for parameter in parameters)


def _fuzzed_cases() -> list[object]:
    """Every operation with schema-valid input; those whose input can be invalid also with it;
    those on one stream also with a stream that exists."""
    cases: list[object] = []
    paths: dict[str, dict[str, dict[str, object]]] = openapi_document()["paths"]  # type: ignore[assignment]
    for path, item in paths.items():
        for method, operation in item.items():
            runs = [(GenerationMode.POSITIVE, False)]
            if _can_be_invalid(operation):
                runs.append((GenerationMode.NEGATIVE, False))
            if "{stream_id}" in path:
                runs.append((GenerationMode.POSITIVE, True))
            for mode, known in runs:
                label = f"{method.upper()} {path} {mode}{' known stream' if known else ''}"
                cases.append(pytest.param(method.upper(), path, mode, known, id=label))
    return cases


def test_openapi_describes_every_route_without_a_key(fuzzed_server: ServerProcess) -> None:
    response = httpx.get(f"{fuzzed_server.base_url}/openapi.json")
    assert response.status_code == 200
    document = response.json()
    assert document["openapi"] == "3.1.0"
    assert set(document["paths"]) == {
        "/v1/streams",
        "/v1/streams/{stream_id}",
        "/v1/streams/{stream_id}/events",
        "/v1/streams/{stream_id}/cancel",
        "/v1/streams/{stream_id}/drop",
        "/v1/streams/{stream_id}/poll",
        "/v1/demo/words",
        "/v1/models",
        "/v1/models/{model_id}",
        "/healthz",
        "/readyz",
        "/openapi.json",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/messages",
        "/v1/responses",
        "/v1/ui/chat",
    }
    create = document["paths"]["/v1/streams"]["post"]
    assert create["security"][-1] == {}  # anonymous mode needs no key
    body_ref = create["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    body = document["components"]["schemas"][body_ref.rsplit("/", 1)[-1]]
    assert body["required"] == ["prompt"]
    assert body["additionalProperties"] is False
    assert body["properties"]["interval_ms"]["maximum"] == 60_000  # the server's own bound
    assert set(create["responses"]) >= {
        *("201", "400", "401", "404", "413", "415", "421", "429", "503")
    }
    unavailable = create["responses"]["503"]
    assert set(unavailable["headers"]) == {"Retry-After"}
    assert unavailable["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/Error"
    }
    # With --redis, every other route on one stream is refused the same way while Redis
    # cannot serve a stream another replica runs.
    for path, method in (
        ("/v1/streams/{stream_id}", "get"),
        ("/v1/streams/{stream_id}/cancel", "post"),
        ("/v1/streams/{stream_id}/drop", "post"),
        ("/v1/streams/{stream_id}/poll", "get"),
    ):
        assert document["paths"][path][method]["responses"]["503"] == unavailable, path
    events = document["paths"]["/v1/streams/{stream_id}/events"]["get"]["responses"]
    assert set(events["200"]["content"]) == {"text/event-stream"}
    assert {"204", "410", "421"} <= set(events)
    assert "503" not in events  # an SSE read is refused with a retry: hint instead


@pytest.mark.parametrize(("method", "path", "mode", "known"), _fuzzed_cases())
def test_fuzzed_requests_get_no_server_error(
    request: pytest.FixtureRequest,
    api_schema: BaseSchema,
    method: str,
    path: str,
    mode: GenerationMode,
    known: bool,
) -> None:
    """Schema-valid input (positive) and input that breaks the schema (negative) alike get
    an answer the description lists, and never a 5xx."""
    operation = api_schema[path][method]
    path_parameters = None
    if known:
        path_parameters = {"stream_id": request.getfixturevalue("known_stream_id")}
    strategy = operation.as_strategy(generation_mode=mode, path_parameters=path_parameters)

    @given(case=strategy)
    @settings(
        max_examples=MAX_EXAMPLES,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def request_answers_as_described(case: Case) -> None:
        response = case.call(timeout=REQUEST_TIMEOUT_S)
        case.validate_response(response, checks=CHECKS)

    request_answers_as_described()
