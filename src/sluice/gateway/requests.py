"""Request bodies and query strings: parsed, bounded, and explained when wrong.

Every request body is JSON and must say so (:func:`check_json_media_type`):
``application/json`` or a ``+json`` type (RFC 6839 section 3.1), with no charset or
``utf-8`` (RFC 8259 section 8.1: JSON between systems is UTF-8; its section 11 defines no
charset parameter, so one that says UTF-8 changes nothing); other parameters are ignored,
and type and subtype are case-insensitive (RFC 9110 section 8.3.1). Anything else, or
none, is ``415`` (RFC 9110 section 15.5.16) before the body is read. A browser sends a
cross-origin POST without asking first (no preflight) only with a form or ``text/plain``
type, or none: refusing those keeps every cross-origin write behind the CORS preflight.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Annotated

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sluice.backends.base import GenerationRequest, model_version
from sluice.errors import BadEventIdError, BadRequestError
from sluice.gateway.auth import ANONYMOUS
from sluice.gateway.errors import (
    JSON_MEDIA_TYPE,
    PayloadTooLargeError,
    UnsupportedMediaTypeError,
)
from sluice.gateway.settings import Settings
from sluice.streams.ids import parse_position
from sluice.transports.asgi import Receive, Scope

__all__ = [
    "MODEL_VERSION_HEADER",
    "ROUTING_KEY_HEADER",
    "CreateStreamBody",
    "check_json_head",
    "check_json_media_type",
    "generation_request",
    "last_event_id",
    "parse_json",
    "read_json_body",
    "receive_body",
    "to_generation_request",
    "version_headers",
    "with_version",
]


class CreateStreamBody(BaseModel):
    """``POST /v1/streams``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str
    model: str | None = None
    interval_ms: Annotated[float, Field(ge=0)] = 0
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    resumable: bool = True
    grace_s: Annotated[float, Field(ge=0)] | None = None
    # Sampling (model backends; ``temperature: 0`` is greedy). Bounds as in SamplingParams.
    temperature: Annotated[float, Field(ge=0, le=100)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0, le=1_000_000)] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stop: Annotated[
        list[Annotated[str, Field(min_length=1, max_length=256)]], Field(max_length=16)
    ] = []
    ignore_eos: bool = False
    speculative: bool = True  # false: never speculate for this request
    # The routing key of a model alias (sluice.rollout.assignment), as OpenAI's ``user``.
    user: Annotated[str, Field(max_length=256)] | None = None


def _explain(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors(include_url=False):
        where = ".".join(str(part) for part in error["loc"]) or "body"
        parts.append(f"{where}: {error['msg']}")
    return "; ".join(parts)


def check_json_media_type(headers: list[tuple[bytes, bytes]]) -> None:
    """Raise :class:`UnsupportedMediaTypeError` unless ``Content-Type`` declares JSON."""
    declared = next((value for name, value in headers if name == b"content-type"), None)
    if declared is None:
        raise UnsupportedMediaTypeError(f"no Content-Type: send the body as {JSON_MEDIA_TYPE}")
    text = declared.decode("latin-1")
    media_type, *parameters = (part.strip() for part in text.split(";"))
    kind, slash, subtype = media_type.lower().partition("/")
    if kind != "application" or not slash or not (subtype == "json" or subtype.endswith("+json")):
        raise UnsupportedMediaTypeError(
            f"Content-Type {text[:80]!r} is not JSON: send the body as {JSON_MEDIA_TYPE}"
        )
    for parameter in parameters:
        name, _, value = parameter.partition("=")
        charset = value.strip().strip('"').lower()
        if name.strip().lower() == "charset" and charset not in ("utf-8", "utf8"):
            raise UnsupportedMediaTypeError(
                f"charset {charset[:40]!r}: JSON bodies are UTF-8 (RFC 8259 section 8.1)"
            )


async def read_json_body(scope: Scope, receive: Receive, max_bytes: int) -> object:
    """Read and parse a JSON request body of at most ``max_bytes`` (declared as JSON)."""
    check_json_head(scope, max_bytes)
    return parse_json(await receive_body(receive, max_bytes))


def check_json_head(scope: Scope, max_bytes: int) -> None:
    """What is refused of a JSON request before its body is read: a body not declared JSON
    (415), or declared longer than ``max_bytes`` (413)."""
    check_json_media_type(scope["headers"])
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                declared = int(value)
            except ValueError:
                raise BadRequestError("malformed Content-Length header") from None
            if declared > max_bytes:
                raise PayloadTooLargeError(f"request body over {max_bytes} bytes")


async def receive_body(receive: Receive, max_bytes: int) -> bytes:
    """An ASGI request's body; :class:`PayloadTooLargeError` past ``max_bytes``."""
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise BadRequestError("client disconnected while sending the body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise PayloadTooLargeError(f"request body over {max_bytes} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def parse_json(body: bytes) -> object:
    """A request body as JSON (an empty or malformed one is a 400)."""
    if not body:
        raise BadRequestError("request body is empty; send a JSON object")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequestError(f"malformed JSON: {exc}") from exc


def parse_create_stream(payload: object, settings: Settings) -> CreateStreamBody:
    """Validate a ``POST /v1/streams`` body against the model and the server's bounds."""
    if not isinstance(payload, dict):
        raise BadRequestError("request body must be a JSON object")
    try:
        body = CreateStreamBody.model_validate(payload)
    except ValidationError as exc:
        raise BadRequestError(_explain(exc)) from exc
    check_bounds(body.prompt, body.interval_ms, body.max_tokens, settings)
    return body


def check_bounds(
    prompt: str, interval_ms: float, max_tokens: int | None, settings: Settings
) -> None:
    """Refuse absurd values with a message naming the bound."""
    if len(prompt) > settings.requests.max_prompt_chars:
        raise BadRequestError(
            f"prompt: {len(prompt)} characters is over the limit of {settings.requests.max_prompt_chars}"
        )
    if not 0 <= interval_ms <= settings.requests.max_interval_ms:
        raise BadRequestError(
            f"interval_ms: must be between 0 and {settings.requests.max_interval_ms:g}, got {interval_ms:g}"
        )
    if max_tokens is not None and not 1 <= max_tokens <= settings.requests.max_tokens_limit:
        raise BadRequestError(
            f"max_tokens: must be between 1 and {settings.requests.max_tokens_limit}, got {max_tokens}"
        )


def to_generation_request(
    prompt: str, interval_ms: float, max_tokens: int | None
) -> GenerationRequest:
    return GenerationRequest(prompt=prompt, max_tokens=max_tokens, interval_s=interval_ms / 1000)


# The key in a request scope's ``state`` of the time.monotonic() its first bytes were parsed.
RECEIVED_AT_STATE = "sluice_received_at"
# Where a client names who a stream is for when its body cannot (a model alias's routing).
ROUTING_KEY_HEADER = "X-Sluice-Routing-Key"
ROUTING_KEY_HEADER_BYTES = ROUTING_KEY_HEADER.lower().encode("ascii")
# Which version of a model alias served a response.
MODEL_VERSION_HEADER = "X-Sluice-Model-Version"
# Longer keys are cut: the hash needs no more, and the head's bounds already hold.
MAX_ROUTING_KEY_BYTES = 256


def stamp_received(scope: Scope) -> None:
    """Note in ``scope`` that its request begins to arrive now (the HTTP protocol's call)."""
    scope.setdefault("state", {})[RECEIVED_AT_STATE] = time.monotonic()


def received(
    generation: GenerationRequest, scope: Scope, tenant: str | None = None
) -> GenerationRequest:
    """``generation`` with the time its request arrived, when the protocol stamped it, and
    its routing key: the body's ``user``, else the ``X-Sluice-Routing-Key`` header, else
    the creator's ``tenant`` (none for anonymous callers: they are drawn at random)."""
    received_at = scope.get("state", {}).get(RECEIVED_AT_STATE)
    key = generation.routing_key or _header(scope, ROUTING_KEY_HEADER_BYTES)
    if key is None and tenant is not None and tenant != ANONYMOUS:
        key = tenant
    if not isinstance(received_at, float):
        received_at = generation.received_at
    if key == generation.routing_key and received_at == generation.received_at:
        return generation
    return dataclasses.replace(generation, received_at=received_at, routing_key=key)


def version_headers(generation: object) -> dict[str, str]:
    """``X-Sluice-Model-Version`` for a stream of a model alias, else nothing."""
    version = model_version(generation)
    return {} if version is None else {MODEL_VERSION_HEADER: version}


def with_version(
    options: tuple[tuple[str, str], ...], generation: object
) -> tuple[tuple[str, str], ...]:
    """A dialect's render options plus ``model_version`` for a stream of a model alias
    (OpenAI renders it as ``system_fingerprint``)."""
    version = model_version(generation)
    return options if version is None else tuple(sorted((*options, ("model_version", version))))


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name and value:
            return bytes(value[:MAX_ROUTING_KEY_BYTES]).decode("latin-1")
    return None


def generation_request(body: CreateStreamBody) -> GenerationRequest:
    """The backend's view of a ``POST /v1/streams`` body."""
    return GenerationRequest(
        prompt=body.prompt,
        max_tokens=body.max_tokens,
        interval_s=body.interval_ms / 1000,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        stop=tuple(body.stop),
        ignore_eos=body.ignore_eos,
        speculative=body.speculative,
        routing_key=body.user or None,
    )


def last_event_id(scope: Scope, query: dict[str, list[str]]) -> tuple[str, int, int] | None:
    """The ``Last-Event-ID`` (header first, then ``?last_event_id=``) as ``(stream, seq,
    frames)`` (see :mod:`sluice.streams.ids`).

    An empty value means "no id" (what EventSource sends when it has none), so an empty
    header leaves the query to say where to resume.
    """
    raw: str | None = None
    for name, value in scope["headers"]:
        if name == b"last-event-id":
            try:
                raw = value.decode("utf-8")
            except UnicodeDecodeError:
                raise BadEventIdError("Last-Event-ID is not valid UTF-8") from None
            break
    if not raw:
        values = query.get("last_event_id")
        if values:
            raw = values[-1]
    if not raw:
        return None
    return parse_position(raw)
