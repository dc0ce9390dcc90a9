"""The one error hierarchy of Sluice.

Every error Sluice raises on purpose derives from :class:`SluiceError`. Third-party
errors are translated at the boundary (``raise ... from exc``) into one of these::

    SluiceError
    ├── ProtocolError                 bytes that break a wire format
    │   ├── SSEEncodeError            a value that cannot be framed (CR/LF in an id, ...)
    │   └── SSEDecodeError            input the SSE decoder refuses
    │       ├── LineTooLongError      a line past the decoder's ``max_line_bytes``
    │       └── EventTooLargeError    an event's data past the decoder's ``max_event_chars``
    ├── StreamError                   about one stream; carries ``stream_id``
    │   ├── StreamNotFoundError       unknown, expired, or never existed
    │   ├── IllegalTransitionError    a state change the state table forbids
    │   ├── ResumeGapError            the asked position is no longer retained
    │   └── DurableStreamError        a Durable Streams request the stream refuses;
    │                                 carries the HTTP ``status`` and protocol headers
    ├── BadRequestError               client input that fails validation
    │   ├── InvalidParameterError     a request field with a bad value; carries ``param``
    │   ├── BadEventIdError           a malformed ``Last-Event-ID`` or stream id
    │   └── UnknownModelError         a model this server does not serve
    ├── BackendError                  a backend failed while generating
    ├── CapacityError                 no room for another stream; carries ``retry_after_s``
    │   └── TenantLimitError          the tenant holds its maximum of live streams (429)
    ├── ConfigError                   settings that cannot work
    └── RolloutError                  an admin action a rollout's state does not allow (409)
"""

from __future__ import annotations

__all__ = [
    "BackendError",
    "BadEventIdError",
    "BadRequestError",
    "CapacityError",
    "ConfigError",
    "DurableStreamError",
    "EventTooLargeError",
    "IllegalTransitionError",
    "InvalidParameterError",
    "LineTooLongError",
    "ProtocolError",
    "ResumeGapError",
    "RolloutError",
    "SSEDecodeError",
    "SSEEncodeError",
    "SluiceError",
    "StreamError",
    "StreamNotFoundError",
    "TenantLimitError",
    "UnknownModelError",
]


class SluiceError(Exception):
    """Base of every error Sluice raises on purpose."""


class ProtocolError(SluiceError):
    """Bytes that break a wire format."""


class SSEEncodeError(ProtocolError, ValueError):
    """A value that cannot be written as an SSE field (for example CR or LF in an id)."""


class SSEDecodeError(ProtocolError):
    """Input the SSE decoder refuses."""


class LineTooLongError(SSEDecodeError):
    """A line grew past the decoder's ``max_line_bytes`` without a line end."""

    def __init__(self, max_line_bytes: int) -> None:
        super().__init__(f"SSE line longer than {max_line_bytes} bytes without a line end")
        self.max_line_bytes = max_line_bytes


class EventTooLargeError(SSEDecodeError):
    """An event's data grew past the decoder's ``max_event_chars`` before its blank line."""

    def __init__(self, max_event_chars: int) -> None:
        super().__init__(f"SSE event data longer than {max_event_chars} characters")
        self.max_event_chars = max_event_chars


class StreamError(SluiceError):
    """An error about one stream."""

    def __init__(self, message: str, *, stream_id: str) -> None:
        super().__init__(message)
        self.stream_id = stream_id


class StreamNotFoundError(StreamError):
    """The stream is unknown: never created, or expired past its retention window."""

    def __init__(self, stream_id: str) -> None:
        super().__init__(f"stream {stream_id!r} not found", stream_id=stream_id)


class IllegalTransitionError(StreamError):
    """A state change the stream state table does not allow."""

    def __init__(self, stream_id: str, current: str, target: str) -> None:
        super().__init__(
            f"stream {stream_id!r}: illegal transition {current} -> {target}", stream_id=stream_id
        )
        self.current = current
        self.target = target


class ResumeGapError(StreamError):
    """A reader asked to resume after an event the log no longer holds."""

    def __init__(self, stream_id: str, after_seq: int, first_retained_seq: int) -> None:
        super().__init__(
            f"stream {stream_id!r}: cannot resume after event {after_seq}; "
            f"the oldest retained event is {first_retained_seq}",
            stream_id=stream_id,
        )
        self.after_seq = after_seq
        self.first_retained_seq = first_retained_seq


class DurableStreamError(StreamError):
    """A Durable Streams request that the stream's state refuses (a closed stream, a
    conflicting configuration, a stale producer, a deleted source ...): the protocol names
    the answer's ``status`` and ``headers`` (``Stream-Closed``, ``Producer-Epoch`` ...)."""

    def __init__(
        self,
        message: str,
        *,
        stream_id: str,
        status: int,
        headers: tuple[tuple[str, str], ...] = (),
    ) -> None:
        super().__init__(message, stream_id=stream_id)
        self.status = status
        self.headers = headers


class BadRequestError(SluiceError):
    """Client input that fails validation; the message says what was wrong."""


class InvalidParameterError(BadRequestError):
    """A request field with a bad value; ``param`` names it (OpenAI reports it)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class BadEventIdError(BadRequestError):
    """A malformed ``Last-Event-ID`` or stream id."""


class UnknownModelError(BadRequestError):
    """A model this server does not serve."""


class BackendError(SluiceError):
    """A backend failed while generating."""

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


class ConfigError(SluiceError, ValueError):
    """Settings that cannot work."""


class RolloutError(SluiceError):
    """An action on a model alias's rollout that its state does not allow, or an unknown
    action; the message names the alias and the state."""


class CapacityError(SluiceError):
    """No room for another stream now; try again after ``retry_after_s`` seconds.

    ``reason`` names the limit for metrics: ``capacity`` (the server's), ``queue_full``
    (the engine's waiting queue), ``ttft_slo`` (the predicted time to first token).
    """

    def __init__(self, message: str, *, retry_after_s: float, reason: str = "capacity") -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.reason = reason


class TenantLimitError(CapacityError):
    """The tenant already holds its maximum of live streams (an HTTP ``429``, where a plain
    :class:`CapacityError` is a ``503``: the server has room, this client does not)."""

    def __init__(self, message: str, *, tenant: str, retry_after_s: float) -> None:
        super().__init__(message, retry_after_s=retry_after_s, reason="tenant_limit")
        self.tenant = tenant
