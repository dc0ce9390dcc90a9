"""What the compatible dialects (OpenAI, Anthropic) share: how a response that ended badly
maps to an HTTP status, the error types both APIs name alike, and the bookkeeping of a
whole (``stream: false``) response up to its terminal event.

Failure table, one for every dialect (each dialect's module doc, decision 5):

==============================  ======  ==================================
terminal event                  status  ``code``
==============================  ======  ==================================
``Finished(cancelled)``         503     ``cancelled`` (a draining server)
``Error``, ``retryable``        503     ``Error.type``
``Error("invalid_request")``    400     ``invalid_request``
``Error("overloaded")``         503     ``overloaded``
``Error("backend_error")``      502     ``backend_error``
any other ``Error``             500     ``Error.type``
==============================  ======  ==================================
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

import orjson

from sluice.errors import ProtocolError
from sluice.events import (
    Error,
    Finished,
    FinishReason,
    NeutralEvent,
    Started,
    TextDelta,
    ToolCallDelta,
    Usage,
)

__all__ = ["SHARED_TYPE_BY_STATUS", "Failure", "WholeResponse", "dumps", "failure_of"]

SHARED_TYPE_BY_STATUS: Final[Mapping[int, str]] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}
"""The error ``type`` both APIs give these statuses; each dialect adds its own."""

_STATUS_BY_ERROR_TYPE: Final[Mapping[str, int]] = {
    "invalid_request": 400,
    "overloaded": 503,
    "backend_error": 502,
}
_CANCELLED_STATUS: Final = 503
_CANCELLED_CODE: Final = "cancelled"
_CANCELLED_MESSAGE: Final = "the stream was cancelled"


@dataclass(frozen=True, slots=True)
class Failure:
    """A stream that ended badly: its HTTP status, neutral code and message, and whether
    it was cancelled rather than failed."""

    status: int
    code: str
    message: str
    cancelled: bool = False


def failure_of(event: Error | Finished) -> Failure:
    """The failure of a terminal ``Error`` or cancelled ``Finished`` (see the table)."""
    if isinstance(event, Finished):
        return Failure(_CANCELLED_STATUS, _CANCELLED_CODE, _CANCELLED_MESSAGE, cancelled=True)
    status = 503 if event.retryable else _STATUS_BY_ERROR_TYPE.get(event.type, 500)
    return Failure(status, event.type, event.message)


def dumps(payload: Mapping[str, object]) -> str:
    """Compact JSON text."""
    return orjson.dumps(payload).decode()


class WholeResponse(ABC):
    """Collects one response's neutral events up to the terminal one.

    Keeps the usage, the dialect's finish reason and the failure; a subclass keeps the
    content (:meth:`_text`, :meth:`_tool_call`), renders the error body
    (:meth:`_failure_body`) and builds the result. ``description``
    names the response in ``ProtocolError`` messages; ``finish_reasons`` is the dialect's
    name for each reason (looked up when the terminal event is fed).
    """

    __slots__ = (
        "_description",
        "_failure",
        "_finish_reason",
        "_finish_reasons",
        "_stop_sequence",
        "_usage",
    )

    def __init__(
        self,
        *,
        description: str,
        finish_reasons: Mapping[FinishReason, str],
    ) -> None:
        self._description = description
        self._finish_reasons = finish_reasons
        self._usage: Usage | None = None
        self._finish_reason: str | None = None
        self._stop_sequence: str | None = None  # the stop string that ended it, if one did
        self._failure: tuple[int, dict[str, object]] | None = None

    @property
    def finished(self) -> bool:
        """True once the terminal event has been fed."""
        return self._finish_reason is not None or self._failure is not None

    def feed(self, event: NeutralEvent) -> None:
        """Take one event; raises :class:`~sluice.errors.ProtocolError` after the terminal one."""
        if self.finished:
            raise ProtocolError(
                f"{self._description}: {type(event).__name__} after the terminal event"
            )
        match event:
            case TextDelta(text=text):
                self._text(text)
                return
            case ToolCallDelta():
                self._tool_call(event)
                return
            case Usage():
                self._usage = event
                return
            case Finished(reason=FinishReason.CANCELLED) | Error():
                failure = failure_of(event)
                self._failure = failure.status, self._failure_body(failure)
                return
            case Finished(reason=reason, stop_sequence=stop_sequence):
                self._finish_reason = self._finish_reasons[reason]
                self._stop_sequence = stop_sequence
                return
            case Started():
                self._started(event)
                return
        raise TypeError(f"not a neutral event: {event!r}")

    def error(self) -> tuple[int, dict[str, object]] | None:
        """The HTTP status and error body if the response failed, else ``None``."""
        return self._failure

    def _finished_well(self) -> str:
        """The dialect's finish reason; raises ``ProtocolError`` unless it finished well."""
        if self._failure is not None:
            raise ProtocolError(f"{self._description} failed: {self._failure[1]}")
        if self._finish_reason is None:
            raise ProtocolError(f"{self._description} has not finished")
        return self._finish_reason

    @abstractmethod
    def result(self) -> dict[str, object]:
        """The whole response; raises ``ProtocolError`` unless it finished well."""

    def _started(self, event: Started) -> None:  # noqa: B027 (a hook, not abstract)
        """The stream's ``Started`` event (nothing to keep by default)."""

    @abstractmethod
    def _text(self, text: str) -> None: ...

    @abstractmethod
    def _tool_call(self, event: ToolCallDelta) -> None: ...

    @abstractmethod
    def _failure_body(self, failure: Failure) -> dict[str, object]: ...
