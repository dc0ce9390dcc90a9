"""Reading an OpenAI-compatible stream: the data of its SSE events in, deltas out (sans-IO).

vLLM, TGI, llama.cpp, Ollama and OpenAI itself stream ``POST /chat/completions`` and
``POST /completions`` as server-sent events of JSON chunks ending in ``data: [DONE]``.
:class:`ChunkReader` turns the data of the events one network chunk completed into one
:class:`~sluice.backends.base.Delta` (fewer, larger deltas; nothing is held back waiting for
more) and keeps the usage and finish reason.

A chunk's ``choices[0].delta.content`` (chat) or ``choices[0].text`` (completions) becomes
a :class:`~sluice.events.TextDelta`, each ``delta.tool_calls[]`` entry a
:class:`~sluice.events.ToolCallDelta`; ``usage`` is kept. ``reasoning_content`` and other
fields are ignored, except vLLM's ``stop_reason``: with finish reason ``stop`` it is the stop
string that matched (or a stop token id), and a string becomes the delta's
``stop_sequence``. Finish reasons outside our four are mapped by ``_FINISH_REASONS``: the
upstream ended the output on purpose (``content_filter``, TGI's ``eos_token``, anything
unknown) -> ``stop``; vLLM's ``abort`` (the engine dropped the request) is a retryable
error.

Errors name the upstream URL and quote upstream text through the ``quote`` given (which
redacts the key): non-JSON data and chunks without the expected fields ->
:class:`~sluice.errors.BackendError`; an in-band ``{"error": ...}`` -> ``BackendError`` with
its message (retryable when its ``code`` is 429, 503 or 5xx).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Final, cast

import orjson

from sluice.backends.base import Delta
from sluice.errors import BackendError
from sluice.events import FinishReason, TextDelta, ToolCallDelta, Usage

__all__ = ["CAPACITY_STATUSES", "DONE_DATA", "ChunkReader", "message_of"]

DONE_DATA: Final = "[DONE]"
"""The data of the event that ends a stream."""

CAPACITY_STATUSES: Final = frozenset({429, 503})
"""HTTP statuses (and in-band error codes) that mean "over capacity, retry later"."""

_FINISH_REASONS: Final[Mapping[str, FinishReason]] = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "tool_calls": FinishReason.TOOL_CALLS,
    "function_call": FinishReason.TOOL_CALLS,  # OpenAI's legacy functions
    "content_filter": FinishReason.STOP,  # ended on purpose; what was sent stands
    "eos_token": FinishReason.STOP,  # TGI
    "stop_sequence": FinishReason.STOP,  # TGI
}
_ABORTED_FINISH_REASON: Final = "abort"  # vLLM: the engine dropped the request


class ChunkReader:
    """Reads one stream's chunks; ``chat`` says chat chunks rather than completion chunks.

    After each :meth:`read`: ``done`` (``[DONE]`` seen), ``finish_reason`` (the last one
    seen), ``usage`` (the last one reported) and ``num_events`` (text and tool call events
    so far).
    """

    __slots__ = (
        "_chat",
        "_quote",
        "_url",
        "done",
        "finish_reason",
        "num_events",
        "stop_sequence",
        "usage",
    )

    def __init__(self, *, url: str, chat: bool, quote: Callable[[str], str]) -> None:
        self._url = url
        self._chat = chat
        self._quote = quote
        self.done = False
        self.finish_reason: FinishReason | None = None
        self.stop_sequence: str | None = None  # vLLM's stop_reason, when a string ended it
        self.num_events = 0
        self.usage: Usage | None = None

    def read(self, data: Iterable[str]) -> Delta | None:
        """Everything the data of these events carry, as one delta (``None`` if nothing);
        nothing after ``[DONE]`` is read."""
        events: list[TextDelta | ToolCallDelta] = []
        reason: FinishReason | None = None
        for item in data:
            if item == DONE_DATA:
                self.done = True
                break
            chunk_reason = self._read_chunk(item, events)
            if chunk_reason is not None:
                reason = chunk_reason
        self.num_events += len(events)
        if reason is not None:
            self.finish_reason = reason
        if events or reason is not None:
            return Delta(events, reason, self.stop_sequence if reason is not None else None)
        return None

    def _read_chunk(
        self, data: str, events: list[TextDelta | ToolCallDelta]
    ) -> FinishReason | None:
        """Append one JSON chunk's events to ``events``; return its finish reason."""
        try:
            payload = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise self._malformed("data that is not JSON", data) from exc
        if not isinstance(payload, dict):
            raise self._malformed("data that is not a JSON object", data)
        error = payload.get("error")
        if error is not None:
            raise self._in_band_error(error, data)
        usage = payload.get("usage")
        if usage is not None:
            self.usage = self._parse_usage(usage, data)
        choices = payload.get("choices")
        if choices is None and usage is not None:
            return None  # the usage-only chunk of include_usage
        if not isinstance(choices, list):
            raise self._malformed("a chunk without choices", data)
        if not choices:
            return None
        choice = choices[0]
        if not isinstance(choice, dict):
            raise self._malformed("a choice that is not an object", data)
        reason = self._finish_reason_of(choice.get("finish_reason"), data)
        if reason is not None:
            matched = choice.get("stop_reason") if choice.get("finish_reason") == "stop" else None
            self.stop_sequence = matched if isinstance(matched, str) and matched else None
        if self._chat:
            delta = choice.get("delta")
            if delta is None and reason is not None:
                return reason
            if not isinstance(delta, dict):
                raise self._malformed("a chat choice without a delta", data)
            content = delta.get("content")
            if content is not None and not isinstance(content, str):
                raise self._malformed("a delta whose content is not a string", data)
            if content:
                events.append(TextDelta(content))
            tool_calls = delta.get("tool_calls")
            if tool_calls:
                self._read_tool_calls(tool_calls, events, data)
        else:
            text = choice.get("text")
            if text is None and reason is not None:
                return reason
            if not isinstance(text, str):
                raise self._malformed("a completion choice without text", data)
            if text:
                events.append(TextDelta(text))
        return reason

    def _read_tool_calls(
        self, tool_calls: object, events: list[TextDelta | ToolCallDelta], data: str
    ) -> None:
        if not isinstance(tool_calls, list):
            raise self._malformed("tool_calls that is not a list", data)
        for position, call in enumerate(tool_calls):
            if not isinstance(call, dict):
                raise self._malformed("a tool call that is not an object", data)
            index = call.get("index", position)
            function = call.get("function") or {}
            if isinstance(index, bool) or not isinstance(index, int):
                raise self._malformed("a tool call without an integer index", data)
            if not isinstance(function, dict):
                raise self._malformed("a tool call whose function is not an object", data)
            call_id = call.get("id")
            name = function.get("name")
            arguments = function.get("arguments") or ""
            if not all(isinstance(v, str | None) for v in (call_id, name, arguments)):
                raise self._malformed("a tool call with non-string fields", data)
            events.append(ToolCallDelta(index, arguments, call_id, name))

    def _finish_reason_of(self, raw: object, data: str) -> FinishReason | None:
        if raw is None:
            return None
        if not isinstance(raw, str):
            raise self._malformed("a finish_reason that is not a string", data)
        if raw == _ABORTED_FINISH_REASON:
            raise BackendError(f"upstream {self._url} aborted the generation", retryable=True)
        return _FINISH_REASONS.get(raw, FinishReason.STOP)  # unknown: ended on purpose

    def _parse_usage(self, usage: object, data: str) -> Usage:
        if isinstance(usage, dict):
            prompt = usage.get("prompt_tokens")
            completion = usage.get("completion_tokens")
            details = usage.get("prompt_tokens_details")
            cached = details.get("cached_tokens") if isinstance(details, dict) else None
            if _is_count(prompt) and _is_count(completion):
                return Usage(
                    prompt_tokens=cast(int, prompt),
                    completion_tokens=cast(int, completion),
                    cached_tokens=cast(int, cached) if _is_count(cached) else 0,
                )
        raise self._malformed("usage without token counts", data)

    def _malformed(self, what: str, data: str) -> BackendError:
        return BackendError(f"upstream {self._url} sent {what}: {self._quote(data)!r}")

    def _in_band_error(self, error: object, data: str) -> BackendError:
        message = message_of({"error": error}) or data
        code = error.get("code") if isinstance(error, dict) else None
        retryable = isinstance(code, int) and (code in CAPACITY_STATUSES or code >= 500)
        return BackendError(
            f"upstream {self._url} reported an error: {self._quote(message)}",
            retryable=retryable,
        )


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def message_of(payload: object) -> str | None:
    """The message of an error body: OpenAI ``{"error": {"message"}}``, TGI ``{"error"}``,
    or ``{"message"}`` / ``{"detail"}``."""
    if not isinstance(payload, dict):
        return None
    for key in ("error", "message", "detail"):
        value = payload.get(key)
        if isinstance(value, dict):
            value = value.get("message")
        if isinstance(value, str) and value:
            return value
    return None
