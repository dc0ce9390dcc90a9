"""The sans-IO side of the Responses WebSocket mode: client messages parsed (and refused
with a reason), the dialect's SSE frames turned into one message each, lanes echoed, and
the ``error`` event's shape."""

from __future__ import annotations

import orjson
import pytest

from sluice.errors import BadRequestError
from sluice.sse import encode_comment, encode_event
from sluice.transports.responses_socket_protocol import (
    CancelResponse,
    CreateResponse,
    error_event,
    parse_responses_message,
    sse_payloads,
)

CREATED = '{"type":"response.created","response":{"id":"resp_a"},"sequence_number":0}'
DELTA = '{"type":"response.output_text.delta","delta":"hi","sequence_number":1}'


def test_create_is_the_post_body_streamed_without_its_envelope() -> None:
    text = '{"type": "response.create", "input": "x", "stream": false, "stream_id": "a"}'
    assert parse_responses_message(text) == CreateResponse({"input": "x", "stream": True}, "a")
    assert parse_responses_message('{"type": "response.create"}') == CreateResponse(
        {"stream": True}, None
    )


def test_cancel_names_its_response() -> None:
    text = '{"type": "response.cancel", "response_id": "resp_a"}'
    assert parse_responses_message(text) == CancelResponse("resp_a")


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("nope", "not JSON"),
        ("[]", "JSON object"),
        ('{"type": "response.steer"}', "unknown message type"),
        ('{"type": "response.cancel", "response_id": 1}', "response_id"),
        ('{"type": "response.create", "stream_id": ""}', "stream_id"),
        ('{"type": "response.create", "stream_id": "' + "x" * 257 + '"}', "stream_id"),
    ],
)
def test_refused_messages_say_why(text: str, says: str) -> None:
    with pytest.raises(BadRequestError, match=says):
        parse_responses_message(text)


def test_each_sse_frame_becomes_one_message_of_its_data_without_ids() -> None:
    blob = encode_event(CREATED, event="response.created", id="str_a:0.1") + encode_event(
        DELTA, event="response.output_text.delta", id="str_a:1"
    )
    assert sse_payloads(blob) == f"{CREATED}\n{DELTA}\n".encode()
    assert sse_payloads(b"") == b""
    assert sse_payloads(encode_comment("ping") + b"\n") == b""


def test_a_lane_is_echoed_first_on_every_message() -> None:
    blob = encode_event(DELTA, event="response.output_text.delta") + encode_event("{}")
    first, second = sse_payloads(blob, "lane-1").split(b"\n")[:2]
    assert orjson.loads(first) == {"stream_id": "lane-1", **orjson.loads(DELTA)}
    assert orjson.loads(second) == {"stream_id": "lane-1"}
    assert first.startswith(b'{"stream_id":"lane-1",')


def test_error_event_is_the_sdks_ws_error() -> None:
    error = {"message": "no", "type": "invalid_request_error", "param": "input", "code": None}
    assert orjson.loads(error_event(400, error)) == {"type": "error", "status": 400, "error": error}
    busy = orjson.loads(error_event(503, error, "b", {"retry-after": "1"}))
    assert busy == {
        "stream_id": "b",
        "type": "error",
        "status": 503,
        "error": {**error, "headers": {"retry-after": "1"}},
    }
    assert error_event(400, error).endswith(b"\n")
    assert error_event(400, error).count(b"\n") == 1
