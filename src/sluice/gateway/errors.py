"""Turning errors into HTTP answers: one JSON shape, one place.

Body: ``{"error": {"type": ..., "code": ..., "message": ...}}`` (the OpenAI error shape, so
every client of ours reads the same thing).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from starlette.responses import JSONResponse, Response

from sluice.errors import (
    BadEventIdError,
    BadRequestError,
    CapacityError,
    DurableStreamError,
    ResumeGapError,
    RolloutError,
    SluiceError,
    StreamNotFoundError,
    TenantLimitError,
    UnknownModelError,
)
from sluice.events import Error

__all__ = [
    "JSON_MEDIA_TYPE",
    "REFUSAL_STATUS",
    "WWW_AUTHENTICATE",
    "AuthenticationError",
    "ErrorAnswer",
    "HeadersTooLargeError",
    "MisdirectedRequestError",
    "PayloadTooLargeError",
    "UnsupportedMediaTypeError",
    "UrlTooLongError",
    "answer_for",
    "error_response",
    "refusal_response",
    "response_for",
    "retry_after",
]

# The error event of a stream whose backend refused the work in ``Generation.start()``, as
# the HTTP status its creation is answered with.
REFUSAL_STATUS = {"overloaded": 503, "invalid_request": 400, "backend_error": 502}


# The media type of every request body the API reads (RFC 8259).
JSON_MEDIA_TYPE = "application/json"

# What a 401 says about how to authenticate (RFC 6750 section 3).
WWW_AUTHENTICATE = 'Bearer realm="sluice"'


class PayloadTooLargeError(BadRequestError):
    """A request body over the configured bound."""


class HeadersTooLargeError(BadRequestError):
    """Request header lines over the configured bound (431)."""


class UrlTooLongError(BadRequestError):
    """A request target over the configured bound (414)."""


class UnsupportedMediaTypeError(BadRequestError):
    """A request body that is not declared JSON (415)."""


class MisdirectedRequestError(BadRequestError):
    """A ``Host`` the server does not answer for (421; see :mod:`sluice.gateway.hosts`)."""


class AuthenticationError(SluiceError):
    """A missing or wrong API key (401); never used for another tenant's stream, which is
    answered as unknown (404) so that its existence does not leak."""


def error_response(
    status: int,
    code: str,
    message: str,
    *,
    headers: dict[str, str] | None = None,
) -> Response:
    """A JSON error response."""
    error_type = "invalid_request_error" if status < 500 else "server_error"
    if status == 401:
        error_type = "authentication_error"
    if status in (429, 503):
        error_type = "overloaded_error"
    payload = {"error": {"type": error_type, "code": code, "message": message}}
    return JSONResponse(payload, status_code=status, headers=headers)


@dataclass(frozen=True, slots=True)
class ErrorAnswer:
    """What an error raised before a response started is answered with, in any dialect."""

    status: int
    code: str
    message: str
    headers: dict[str, str] = field(default_factory=dict)


def answer_for(exc: SluiceError) -> ErrorAnswer:
    """The status, code, message and headers for ``exc`` (one table for every dialect)."""
    message = str(exc)
    if isinstance(exc, AuthenticationError):
        return ErrorAnswer(401, "invalid_api_key", message, {"WWW-Authenticate": WWW_AUTHENTICATE})
    if isinstance(exc, StreamNotFoundError):
        return ErrorAnswer(404, "stream_not_found", message)
    if isinstance(exc, DurableStreamError):
        code = _DURABLE_CODES.get(exc.status, "conflict")
        return ErrorAnswer(exc.status, code, message, dict(exc.headers))
    if isinstance(exc, UnknownModelError):
        return ErrorAnswer(404, "model_not_found", message)
    if isinstance(exc, PayloadTooLargeError):
        return ErrorAnswer(413, "payload_too_large", message)
    if isinstance(exc, HeadersTooLargeError):
        return ErrorAnswer(431, "headers_too_large", message)
    if isinstance(exc, UrlTooLongError):
        return ErrorAnswer(414, "url_too_long", message)
    if isinstance(exc, UnsupportedMediaTypeError):
        return ErrorAnswer(415, "unsupported_media_type", message, {"Accept": JSON_MEDIA_TYPE})
    if isinstance(exc, MisdirectedRequestError):
        return ErrorAnswer(421, "misdirected_request", message)
    if isinstance(exc, ResumeGapError):
        return ErrorAnswer(410, "resume_gap", message)
    if isinstance(exc, BadEventIdError):
        return ErrorAnswer(400, "bad_event_id", message)
    if isinstance(exc, BadRequestError):
        return ErrorAnswer(400, "invalid_request", message)
    if isinstance(exc, RolloutError):
        return ErrorAnswer(409, "rollout_conflict", message)
    if isinstance(exc, TenantLimitError):
        return ErrorAnswer(429, "rate_limited", message, _retry(exc))
    if isinstance(exc, CapacityError):
        return ErrorAnswer(503, "overloaded", message, _retry(exc))
    return ErrorAnswer(500, "internal_error", "internal server error")


# The codes of the Durable Streams protocol's refusals, by status.
_DURABLE_CODES = {403: "stale_producer_epoch", 409: "conflict", 410: "stream_gone"}


def _retry(exc: CapacityError) -> dict[str, str]:
    return {"Retry-After": retry_after(exc.retry_after_s)}


def response_for(exc: SluiceError) -> Response:
    """The HTTP answer for an error raised before a response started."""
    answer = answer_for(exc)
    return error_response(
        answer.status, answer.code, answer.message, headers=answer.headers or None
    )


def retry_after(seconds: float) -> str:
    """A ``Retry-After`` value: whole seconds, at least 1."""
    return str(max(1, round(seconds)))


def refusal_response(error: Error, refusal: CapacityError | None) -> Response:
    """The answer to a create whose backend refused the work before it started
    (``refusal`` is the backend's own capacity error, when that was the cause)."""
    status = REFUSAL_STATUS.get(error.type, 500)
    headers = None
    if status == 503:
        headers = {"Retry-After": retry_after(refusal.retry_after_s if refusal else 1.0)}
    return error_response(status, error.type, error.message, headers=headers)
