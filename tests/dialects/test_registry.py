"""The dialect registry: every dialect it lists keeps the seam's contract (pure: no server).

A new dialect is one module and one registry line; these checks run on it unchanged.
"""

from __future__ import annotations

import orjson
import pytest

from sluice.dialects.base import ApiDialect, RequestLimits
from sluice.dialects.registry import API_DIALECTS, DIALECTS, NATIVE, dialect
from sluice.errors import BadRequestError, ProtocolError
from sluice.events import (
    Error,
    Finished,
    FinishReason,
    NeutralEvent,
    RenderMeta,
    Started,
    TextDelta,
    Usage,
)

EVENTS: list[NeutralEvent] = [
    Started("m", 1700, 5),
    TextDelta("Hel"),
    TextDelta("lo"),
    Usage(5, 2),
    Finished(FinishReason.STOP),
]
IDS = [speaker.name for speaker in API_DIALECTS]


def meta(name: str, *, include_usage: bool = True) -> RenderMeta:
    return RenderMeta(name, "resp_1", "m", 1700, resumable=True, include_usage=include_usage)


def test_every_dialect_is_listed_under_its_own_name() -> None:
    assert {name: d.name for name, d in DIALECTS.items()} == {name: name for name in DIALECTS}
    assert dialect("native") is NATIVE
    assert NATIVE.retry_hint
    with pytest.raises(KeyError):
        dialect("no-such-dialect")


def test_api_dialects_have_distinct_paths_and_response_id_prefixes() -> None:
    paths = [speaker.path for speaker in API_DIALECTS]
    prefixes = [speaker.response_id_prefix for speaker in API_DIALECTS]
    assert len(set(paths)) == len(paths)
    assert all(path.startswith("/v1/") for path in paths)
    assert len(set(prefixes)) == len(prefixes)
    assert all(prefixes)


@pytest.mark.parametrize("speaker", API_DIALECTS, ids=IDS)
def test_a_stream_renders_to_messages_of_text_and_nothing_after_its_end(
    speaker: ApiDialect,
) -> None:
    renderer = speaker.renderer(meta(speaker.name))
    messages = [message for event in EVENTS for message in renderer.render(event)]
    assert messages
    for name, data in messages:
        assert name is None or (name and "\n" not in name)
        assert "\n" not in data  # one SSE data line each
        assert "\r" not in data
    with pytest.raises(ProtocolError):
        renderer.render(TextDelta("late"))


@pytest.mark.parametrize("speaker", API_DIALECTS, ids=IDS)
def test_a_whole_answer_carries_the_text_or_the_failure(speaker: ApiDialect) -> None:
    whole = speaker.whole(meta(speaker.name))
    for event in EVENTS:
        whole.feed(event)
    assert whole.error() is None
    assert "Hello" in orjson.dumps(whole.result()).decode()

    failed = speaker.whole(meta(speaker.name))
    for event in (Started("m", 1700), Error("backend_error", "it broke", retryable=False)):
        failed.feed(event)
    failure = failed.error()
    assert failure is not None
    status, body = failure
    assert status == 502
    assert "it broke" in orjson.dumps(body).decode()


@pytest.mark.parametrize("speaker", API_DIALECTS, ids=IDS)
def test_bodies_that_are_not_json_objects_are_refused(speaker: ApiDialect) -> None:
    for payload in ([], "text", 3, None):
        with pytest.raises(BadRequestError):
            speaker.parse(payload, RequestLimits())


@pytest.mark.parametrize("speaker", API_DIALECTS, ids=IDS)
def test_error_bodies_carry_the_message(speaker: ApiDialect) -> None:
    for status in (400, 404, 429, 503):
        body = speaker.error_body(status, "no such thing", code="model_not_found")
        assert "no such thing" in orjson.dumps(body).decode()
    assert isinstance(speaker.headers(meta(speaker.name)), dict)
