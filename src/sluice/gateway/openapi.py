"""``GET /openapi.json``: an OpenAPI 3.1 description of the HTTP API.

Request bodies are the JSON schemas of the pydantic models that parse them (so the
description cannot drift from what is accepted), with the server's own bounds from its
:class:`~sluice.gateway.settings.Settings`; responses list every status a route can answer
before its body starts, in the shape that route answers it. A ``text/event-stream`` body's
schema describes one event as parsed (``event``, ``data``, ``id``, ``retry``), the
convention OpenAPI 3.2 names ``itemSchema``; what each event's data holds is in the README.

The description is built per request from the models: nothing happens at import time, and
it needs no key (like ``/healthz``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from sluice import __version__
from sluice.dialects.registry import API_DIALECTS
from sluice.gateway.auth import RESUME_TOKEN_HEADER, TOKEN_PARAM
from sluice.gateway.requests import CreateStreamBody
from sluice.gateway.settings import Settings
from sluice.streams.ids import MAX_EVENT_ID_CHARS
from sluice.streams.state import StreamState
from sluice.transports.longpoll import DEFAULT_POLL_TIMEOUT_S, MAX_POLL_EVENTS, MAX_POLL_TIMEOUT_S

__all__ = ["openapi_document", "openapi_endpoint"]

JSON = dict[str, object]

_REF = "#/components/schemas/{model}"
# Per registered dialect (by name): operation id, summary, its request body's public name,
# and the prefix of its answer, event and error schemas. A dialect missing here fails
# every test that reads this description.
_DESCRIBED: dict[str, tuple[str, str, str, str]] = {
    "openai_chat": (
        "createChatCompletion",
        "OpenAI Chat Completions",
        "ChatCompletionRequest",
        "OpenAI",
    ),
    "openai_completions": ("createCompletion", "OpenAI Completions", "CompletionRequest", "OpenAI"),
    "anthropic": ("createMessage", "Anthropic Messages", "MessagesRequest", "Anthropic"),
    "openai_responses": ("createResponse", "OpenAI Responses", "ResponsesRequest", "Responses"),
    "vercel_ui": ("createUIChat", "Vercel AI SDK UI message stream", "UIChatRequest", "UIChat"),
}


def _bodies() -> dict[str, type[BaseModel]]:
    """Public names for the request models (the dialects' own classes may be private)."""
    compat = {_DESCRIBED[d.name][2]: d.request_model for d in API_DIALECTS}
    return {"CreateStreamRequest": CreateStreamBody, **compat}


_SSE = "text/event-stream"
_JSON = "application/json"


def _security(*, stream: bool) -> list[JSON]:
    """Who may call: a key, a resume token (on one stream), or anyone in anonymous mode."""
    schemes = ["bearerAuth", "apiKeyHeader"]
    if stream:
        schemes += ["resumeTokenQuery", "resumeTokenHeader"]
    requirements: list[JSON] = [{scheme: []} for scheme in schemes]
    return [*requirements, {}]


def _ref(name: str) -> JSON:
    return {"$ref": _REF.format(model=name)}


def _content(schema: JSON, *media_types: str) -> JSON:
    return {media_type: {"schema": schema} for media_type in media_types or (_JSON,)}


def _header(description: str, *, required: bool = False) -> JSON:
    return {"description": description, "required": required, "schema": {"type": "string"}}


_RETRY_AFTER = _header("seconds to wait before retrying")
# What an SSE read answers where others answer 503: EventSource stops on any other status.
_RETRY_HINT = "only a `retry:` hint when the server is full or Redis cannot serve the stream"


def _error(description: str, schema: str, *, headers: JSON | None = None) -> JSON:
    response: JSON = {"description": description, "content": _content(_ref(schema))}
    if headers:
        response["headers"] = headers
    return response


def _errors(schema: str, statuses: Iterable[int]) -> dict[str, JSON]:
    """The error responses of a route, in ``schema``'s shape.

    414, 421 and 431 are answered before routing, so always in the native shape.
    """
    descriptions = {
        400: (
            "bad request: malformed JSON, a missing or wrong-typed field, a value out of"
            " range, a malformed stream id or Last-Event-ID"
        ),
        401: "missing or wrong API key",
        404: "unknown stream (or another tenant's, or a forged or expired token) or model",
        410: (
            "resume_gap: the log no longer holds the position asked for (a fresh read"
            " included, when the first events are gone); EventSource stops for good"
        ),
        413: "request body over 1 MiB",
        414: "request target over 8 KiB",
        415: "the body is not declared JSON (application/json or +json, UTF-8)",
        421: (
            "a Host this server does not answer for (while it serves callers without a"
            " key: loopback names and --allowed-host ones)"
        ),
        429: "the tenant holds its maximum number of streams",
        431: "request header lines over 16 KiB in all",
        502: "the backend failed before the stream started",
        503: (
            "refused for now: the server is full (connections, streams or the engine's"
            " queue) or draining, or, with --redis, Redis cannot serve the request (a"
            " creation's admission, or a stream another replica runs)"
        ),
    }
    responses: dict[str, JSON] = {}
    for status in statuses:
        headers: JSON | None = None
        if status == 401:
            headers = {"WWW-Authenticate": _header("how to authenticate", required=True)}
        elif status in (429, 503):
            headers = {"Retry-After": _RETRY_AFTER}
        elif status == 415:
            headers = {"Accept": _header("the media type to send", required=True)}
        shape = "Error" if status in _BEFORE_ROUTING else schema
        responses[str(status)] = _error(descriptions[status], shape, headers=headers)
    return responses


# Answered before a route is chosen (the head's bounds, the Host), for every route.
_BEFORE_ROUTING = (414, 421, 431)


def _param(where: str, name: str, schema: JSON, description: str = "") -> JSON:
    """A parameter; only path parameters are required (and ``text`` of the demo)."""
    required = where == "path" or name == "text"
    parameter: JSON = {"name": name, "in": where, "required": required, "schema": schema}
    if description:
        parameter["description"] = description
    return parameter


_STREAM_ID_PATTERN = "str_[0-9A-Za-z]{22}"
# Empty is "no id" (what EventSource sends first); frame ids `.<k>` are the dialects'.
_EVENT_ID_PATTERN = rf"^({_STREAM_ID_PATTERN}:(0|[1-9][0-9]{{0,17}})(\.[1-9][0-9]{{0,3}})?)?$"


# A long-poll cursor: an event id, never a frame id.
_CURSOR = rf"^{_STREAM_ID_PATTERN}:(0|[1-9][0-9]{{0,17}})$"


def _stream_parameters() -> list[JSON]:
    """The stream a request names, and the resume token that may stand in for a key."""
    token = "the stream's resume token"
    return [
        _param("path", "stream_id", {"type": "string", "pattern": f"^{_STREAM_ID_PATTERN}$"}),
        _param("query", TOKEN_PARAM, {"type": "string"}, f"{token} (what EventSource can send)"),
        _param("header", RESUME_TOKEN_HEADER, {"type": "string"}, token),
    ]


def _last_event_id() -> list[JSON]:
    description = "resume after this event, `<stream_id>:<n>` (the header wins)"
    schema: JSON = {"type": "string", "maxLength": MAX_EVENT_ID_CHARS, "pattern": _EVENT_ID_PATTERN}
    return [
        _param("header", "Last-Event-ID", schema, description),
        _param("query", "last_event_id", schema, description),
    ]


def _operation(
    operation_id: str,
    summary: str,
    responses: dict[str, JSON],
    *,
    security: list[JSON] | None = None,
    parameters: list[JSON] | None = None,
    body: str | None = None,
) -> JSON:
    operation: JSON = {"operationId": operation_id, "summary": summary, "responses": responses}
    operation["security"] = security if security is not None else []
    if parameters:
        operation["parameters"] = parameters
    if body is not None:
        operation["requestBody"] = {"required": True, "content": _content(_ref(body))}
    return operation


def _ok(description: str, schema: JSON, *media_types: str) -> dict[str, JSON]:
    return {"200": {"description": description, "content": _content(schema, *media_types)}}


def _native_paths(settings: Settings) -> dict[str, JSON]:
    created: JSON = {
        "description": "the stream was created",
        "headers": {"Location": _header("the stream's URL", required=True)},
        "content": _content(_ref("CreatedStream")),
    }
    on_stream = _stream_parameters()
    interval: JSON = {"type": "number", "minimum": 0, "maximum": settings.requests.max_interval_ms}
    max_tokens: JSON = {
        "type": "integer",
        "minimum": 1,
        "maximum": settings.requests.max_tokens_limit,
    }
    head = (400, 401, 404, *_BEFORE_ROUTING)
    # With --redis a stream another replica runs is looked up and followed through Redis:
    # 503 + Retry-After while Redis cannot (an SSE read gets a retry: hint instead).
    followed = (*head, 503)
    sse_head = (*head, 410)
    sse = _ref("NativeEvent")
    return {
        "/v1/streams": {
            "post": _operation(
                "createStream",
                "Start a stream",
                {"201": created, **_errors("Error", (*head, 413, 415, 429, 502, 503))},
                security=_security(stream=False),
                body="CreateStreamRequest",
            )
        },
        "/v1/streams/{stream_id}": {
            "get": _operation(
                "getStream",
                "Describe a stream",
                {**_ok("the stream", _ref("Stream")), **_errors("Error", followed)},
                security=_security(stream=True),
                parameters=on_stream,
            )
        },
        "/v1/streams/{stream_id}/events": {
            "get": _operation(
                "readStream",
                "Read a stream's events (SSE), replaying after Last-Event-ID",
                {
                    **_ok(f"the events, then live ones (or {_RETRY_HINT})", sse, _SSE),
                    "204": {"description": "the stream is over: nothing left to send"},
                    **_errors("Error", sse_head),
                },
                security=_security(stream=True),
                parameters=[*on_stream, *_last_event_id()],
            )
        },
        "/v1/streams/{stream_id}/cancel": {
            "post": _operation(
                "cancelStream",
                "Cancel a stream",
                {
                    "202": {"description": "cancelling", "content": _content(_ref("Stream"))},
                    **_errors("Error", followed),
                },
                security=_security(stream=True),
                parameters=on_stream,
            )
        },
        "/v1/streams/{stream_id}/drop": {
            "post": _operation(
                "dropConnections",
                "Close every connection reading a stream (its clients resume)",
                {**_ok("dropped", _ref("Dropped")), **_errors("Error", followed)},
                security=_security(stream=True),
                parameters=on_stream,
            )
        },
        "/v1/streams/{stream_id}/poll": {
            "get": _operation(
                "pollStream",
                "Long-poll a stream's events after a cursor (JSON batches)",
                {
                    **_ok("the events after the cursor (none: timed out)", _ref("PollAnswer")),
                    "204": {"description": "the stream is over: nothing after the cursor"},
                    **_errors("Error", (*followed, 410)),
                },
                security=_security(stream=True),
                parameters=[
                    *on_stream,
                    _param(
                        "query",
                        "after",
                        {"type": "string", "maxLength": MAX_EVENT_ID_CHARS, "pattern": _CURSOR},
                        "the cursor `<stream_id>:<n>`: events after event n (default: all)",
                    ),
                    _param(
                        "query",
                        "timeout_s",
                        {"type": "number", "minimum": 0, "maximum": MAX_POLL_TIMEOUT_S},
                        f"how long to hold when nothing is there (default {DEFAULT_POLL_TIMEOUT_S:g})",
                    ),
                ],
            )
        },
        "/v1/demo/words": {
            "get": _operation(
                "demoWords",
                "Start a resumable `words` stream and read it (SSE)",
                {
                    **_ok(f"the events (or {_RETRY_HINT})", sse, _SSE),
                    "204": {"description": "the resumed stream is over"},
                    **_errors("Error", (*sse_head, 429)),
                },
                security=_security(stream=True),
                parameters=[
                    _param("query", "text", {"type": "string"}, "the words to stream"),
                    _param("query", "interval_ms", interval, "the pace (default 50)"),
                    _param("query", "max_tokens", max_tokens),
                    *_last_event_id(),
                ],
            )
        },
        "/v1/models": {
            "get": _operation(
                "listModels",
                "The served models, the default first",
                {
                    **_ok("the models", _ref("ModelList")),
                    **_errors("Error", (401, *_BEFORE_ROUTING)),
                },
                security=_security(stream=False),
            )
        },
        "/v1/models/{model_id}": {
            "get": _operation(
                "retrieveModel",
                "One served model (OpenAI's retrieve)",
                {
                    **_ok("the model", _ref("Model")),
                    "404": _error("no model of that id is served", "OpenAIError"),
                    **_errors("Error", (401, *_BEFORE_ROUTING)),
                },
                security=_security(stream=False),
                parameters=[
                    _param("path", "model_id", {"type": "string"}, "may hold '/'"),
                ],
            )
        },
        "/healthz": {
            "get": _operation(
                "healthz",
                "Liveness",
                {**_ok("alive", _ref("Health")), **_errors("Error", _BEFORE_ROUTING)},
            )
        },
        "/readyz": {
            "get": _operation(
                "readyz",
                "Readiness (503 while draining)",
                {
                    **_ok("ready", _ref("Health")),
                    "503": {"description": "draining", "content": _content(_ref("Health"))},
                    **_errors("Error", _BEFORE_ROUTING),
                },
            )
        },
        "/openapi.json": {
            "get": _operation(
                "openapi",
                "This description",
                {**_ok("OpenAPI 3.1", {"type": "object"}), **_errors("Error", _BEFORE_ROUTING)},
            )
        },
    }


def _compat_paths() -> dict[str, JSON]:
    statuses = (400, 401, 404, 413, 415, 429, 502, 503, *_BEFORE_ROUTING)
    resumable = _param(
        "header",
        "X-Sluice-Resumable",
        {"type": "string"},
        "`true`: SSE ids, and the stream survives a disconnect (any other value: it does not)",
    )

    def answer(schema: str, events: str) -> dict[str, JSON]:
        return {
            "200": {
                "description": "the whole answer, or its events",
                "headers": {"X-Sluice-Stream-Id": _header("the stream id")},
                "content": {_JSON: {"schema": _ref(schema)}, _SSE: {"schema": _ref(events)}},
            }
        }

    def compat(operation_id: str, summary: str, body: str, dialect: str) -> JSON:
        answer_schema = f"{dialect}Response"
        errors = "OpenAIError" if dialect in ("Responses", "UIChat") else f"{dialect}Error"
        return {
            "post": _operation(
                operation_id,
                summary,
                {**answer(answer_schema, f"{dialect}Event"), **_errors(errors, statuses)},
                security=_security(stream=False),
                parameters=[resumable],
                body=body,
            )
        }

    return {d.path: compat(*_DESCRIBED[d.name]) for d in API_DIALECTS}


def _string_fields(*names: str) -> JSON:
    return {name: {"type": "string"} for name in names}


def _response_schemas() -> dict[str, JSON]:
    state = {"type": "string", "enum": [state.value for state in StreamState]}
    stream: JSON = {
        "type": "object",
        "required": ["id", "model", "state", "resumable", "events", "tokens", "readers"],
        "properties": {
            **_string_fields("id", "model"),
            "state": state,
            "resumable": {"type": "boolean"},
            "created": {"type": "integer"},
            "events": {"type": "integer", "minimum": 0},
            "tokens": {"type": "integer", "minimum": 0},
            "readers": {"type": "integer", "minimum": 0},
            "finish_reason": {"type": ["string", "null"]},
        },
    }
    created: JSON = {
        "allOf": [
            _ref("Stream"),
            {
                "type": "object",
                "required": ["events_url", "cancel_url", "resume_token"],
                "properties": _string_fields("events_url", "cancel_url", "resume_token"),
            },
        ]
    }

    def envelope(required: list[str], error_required: list[str]) -> JSON:
        return {
            "type": "object",
            "required": [*required, "error"],
            "properties": {
                "error": {
                    "type": "object",
                    "required": error_required,
                    "properties": {
                        "type": {"type": "string"},
                        "message": {"type": "string"},
                        "code": {"type": ["string", "null"]},
                        "param": {"type": ["string", "null"]},
                    },
                }
            },
        }

    def event(names: list[str] | None, required: list[str]) -> JSON:
        """One SSE event, as parsed: its ``data`` lines joined (JSON, or OpenAI's ``[DONE]``)."""
        name: JSON = {"type": "string"} if names is None else {"enum": names}
        return {
            "type": "object",
            "required": ["event", "data", *required],
            "properties": {
                "event": name,
                "data": {"type": "string"},
                "id": {"type": "string"},
                "retry": {"type": "integer", "minimum": 0},
            },
        }

    anthropic_events = [
        *("message_start", "ping", "message_delta", "message_stop", "error"),
        *("content_block_start", "content_block_delta", "content_block_stop"),
    ]
    responses_events = [
        *("response.created", "response.in_progress", "response.completed"),
        *("response.incomplete", "response.failed", "error"),
        *("response.output_item.added", "response.output_item.done"),
        *("response.content_part.added", "response.content_part.done"),
        *("response.output_text.delta", "response.output_text.done"),
        *("response.function_call_arguments.delta", "response.function_call_arguments.done"),
    ]
    return {
        "NativeEvent": event(["start", "token", "usage", "done", "error"], ["id"]),
        "OpenAIEvent": event(["message"], []),
        "AnthropicEvent": event(anthropic_events, []),
        "ResponsesEvent": event(responses_events, []),
        "UIChatEvent": {
            "type": "object",
            "description": "a UI message chunk as JSON (its `type` says which), or `[DONE]`",
            "required": ["data"],
            "properties": {"data": {"type": "string"}},
        },
        "Stream": stream,
        "CreatedStream": created,
        "PollAnswer": {
            "type": "object",
            "required": ["events", "next", "done"],
            "properties": {
                "events": {
                    "type": "array",
                    "maxItems": MAX_POLL_EVENTS,
                    "items": {
                        "type": "object",
                        "required": ["id", "event", "data"],
                        "properties": {
                            "id": {"type": "string"},
                            "event": {
                                "enum": ["start", "token", "tool_call", "usage", "done", "error"]
                            },
                            "data": {"type": "object"},
                        },
                    },
                },
                "next": {"type": "string", "description": "the cursor of the next poll"},
                "done": {"type": "boolean", "description": "the terminal event was given"},
            },
        },
        "Dropped": {
            "type": "object",
            "required": ["id", "dropped"],
            "properties": {"id": {"type": "string"}, "dropped": {"type": "integer"}},
        },
        "Model": {
            "type": "object",
            "required": ["id", "object", "created", "owned_by"],
            "properties": {
                **_string_fields("id", "owned_by"),
                "object": {"const": "model"},
                "created": {"type": "integer", "description": "when this server began to serve it"},
            },
        },
        "ModelList": {
            "type": "object",
            "required": ["object", "data"],
            "properties": {
                "object": {"const": "list"},
                "data": {"type": "array", "items": _ref("Model")},
            },
        },
        "Health": {
            "type": "object",
            "required": ["status"],
            "properties": {"status": {"type": "string"}},
        },
        "Error": envelope([], ["type", "code", "message"]),
        "OpenAIError": envelope([], ["type", "message"]),
        "AnthropicError": {
            **envelope(["type"], ["type", "message"]),
        },
        "OpenAIResponse": {
            "type": "object",
            "required": ["id", "object", "created", "model", "choices"],
            "properties": {
                **_string_fields("id", "object", "model"),
                "created": {"type": "integer"},
                "choices": {"type": "array", "items": {"type": "object"}},
            },
        },
        "ResponsesResponse": {
            "type": "object",
            "required": ["id", "object", "created_at", "model", "status", "output"],
            "properties": {
                **_string_fields("id", "model", "status"),
                "object": {"const": "response"},
                "created_at": {"type": "integer"},
                "output": {"type": "array", "items": {"type": "object"}},
            },
        },
        "UIChatResponse": {
            "type": "object",
            "description": 'the assistant\'s UIMessage (`"stream": false`)',
            "required": ["id", "role", "parts"],
            "properties": {
                "id": {"type": "string"},
                "role": {"const": "assistant"},
                "parts": {"type": "array", "items": {"type": "object"}},
                "metadata": {"type": "object"},
            },
        },
        "AnthropicResponse": {
            "type": "object",
            "required": ["id", "type", "role", "content"],
            "properties": {
                **_string_fields("id", "model"),
                "type": {"const": "message"},
                "role": {"const": "assistant"},
                "content": {"type": "array", "items": {"type": "object"}},
            },
        },
    }


def _bound(field: JSON, keyword: str, value: float) -> None:
    """Set ``keyword`` on the branch of ``field`` that ``keyword`` applies to."""
    kind = ("string",) if keyword == "maxLength" else ("integer", "number")
    branches = field.get("anyOf")
    for branch in [field, *(branches if isinstance(branches, list) else [])]:
        if isinstance(branch, dict) and branch.get("type") in kind:
            branch[keyword] = value


def _settings_bounds(schemas: dict[str, JSON], settings: Settings) -> None:
    """The server's own bounds (``check_bounds`` and friends), which the models leave out."""
    for name in ("CreateStreamRequest", "ChatCompletionRequest", "CompletionRequest"):
        fields: dict[str, JSON] = schemas[name]["properties"]  # type: ignore[assignment]
        for tokens in ("max_tokens", "max_completion_tokens"):
            if tokens in fields:
                _bound(fields[tokens], "maximum", settings.requests.max_tokens_limit)
        if "prompt" in fields:
            _bound(fields["prompt"], "maxLength", settings.requests.max_prompt_chars)
    for name, tokens in (
        ("MessagesRequest", "max_tokens"),
        ("ResponsesRequest", "max_output_tokens"),
        ("UIChatRequest", "max_tokens"),
    ):
        body: dict[str, JSON] = schemas[name]["properties"]  # type: ignore[assignment]
        _bound(body[tokens], "maximum", settings.requests.max_tokens_limit)
    native: dict[str, JSON] = schemas["CreateStreamRequest"]["properties"]  # type: ignore[assignment]
    _bound(native["interval_ms"], "maximum", settings.requests.max_interval_ms)


def openapi_document(settings: Settings | None = None) -> JSON:
    """The whole description of a server with ``settings``, as a JSON-ready dict."""
    bodies = _bodies()
    _, definitions = models_json_schema(
        [(model, "validation") for model in bodies.values()], ref_template=_REF
    )
    schemas: dict[str, JSON] = dict(definitions.get("$defs", {}))
    for public, model in bodies.items():
        # Named after their classes; no schema refers to a request body, so a rename is safe.
        schemas[public] = schemas.pop(model.__name__)
    settings = settings or Settings()
    _settings_bounds(schemas, settings)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Sluice",
            "version": __version__,
            "description": "Resumable, cancellable LLM token streams over Server-Sent Events.",
        },
        "paths": {**_native_paths(settings), **_compat_paths()},
        "components": {
            "schemas": {**schemas, **_response_schemas()},
            "securitySchemes": {
                "bearerAuth": {"type": "http", "scheme": "bearer"},
                "apiKeyHeader": {"type": "apiKey", "in": "header", "name": "x-api-key"},
                "resumeTokenQuery": {"type": "apiKey", "in": "query", "name": TOKEN_PARAM},
                "resumeTokenHeader": {
                    "type": "apiKey",
                    "in": "header",
                    "name": RESUME_TOKEN_HEADER,
                },
            },
        },
    }


def openapi_endpoint(settings: Settings) -> Callable[[Request], Awaitable[Response]]:
    """The ``GET /openapi.json`` handler of a server with ``settings``."""

    async def openapi_json(request: Request) -> Response:
        return JSONResponse(openapi_document(settings))

    return openapi_json
