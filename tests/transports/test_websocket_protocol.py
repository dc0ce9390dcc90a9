"""The sans-IO pieces of the JSON transports: WebSocket client messages in, WebSocket and
long-poll messages out, and the long-poll query's rules. No socket, no loop."""

from __future__ import annotations

import orjson
import pytest
from websockets.frames import Frame, Opcode
from websockets.protocol import State
from websockets.server import ServerProtocol

from sluice.errors import BadRequestError, InvalidParameterError
from sluice.events import Error, Finished, FinishReason, NeutralEvent, Started, TextDelta, Usage
from sluice.streams.log import Batch
from sluice.transports.longpoll import (
    DEFAULT_POLL_TIMEOUT_S,
    PollQuery,
    encode_poll,
    parse_poll_query,
)
from sluice.transports.native_json import native_message
from sluice.transports.websocket_protocol import (
    Cancel,
    Create,
    Subscribe,
    WebSocketFrames,
    WebSocketLimits,
    created_message,
    error_message,
    parse_client_message,
    server_text_frame,
    split_messages,
)

SID = "str_" + "A" * 22
EVENTS = (
    Started("m", 7),
    TextDelta("a\nb"),
    TextDelta(' "c"'),
    Usage(1, 2, 0),
    Finished(FinishReason.STOP),
)


def test_client_messages_parse_to_values() -> None:
    assert parse_client_message('{"type": "create", "request": {"prompt": "x"}}') == Create(
        {"prompt": "x"}
    )
    assert parse_client_message(
        f'{{"type": "subscribe", "stream_id": "{SID}", "last_event_id": "{SID}:3"}}'
    ) == Subscribe(SID, f"{SID}:3")
    assert parse_client_message(
        f'{{"type": "subscribe", "stream_id": "{SID}", "last_event_id": null}}'
    ) == Subscribe(SID, None)
    assert parse_client_message(f'{{"type": "subscribe", "stream_id": "{SID}"}}') == Subscribe(
        SID, None
    )
    assert parse_client_message(f'{{"type": "cancel", "stream_id": "{SID}"}}') == Cancel(SID)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "not JSON"),
        ("{", "not JSON"),
        ('"create"', "JSON object"),
        ("[]", "JSON object"),
        ("{}", "unknown message type None"),
        ('{"type": "CREATE"}', "unknown message type 'CREATE'"),
        ('{"type": "create"}', "'request'"),
        ('{"type": "create", "request": []}', "'request'"),
        ('{"type": "subscribe"}', "'stream_id'"),
        ('{"type": "subscribe", "stream_id": null}', "'stream_id'"),
        (f'{{"type": "subscribe", "stream_id": "{SID}", "last_event_id": 3}}', "last_event_id"),
        ('{"type": "cancel", "stream_id": ["x"]}', "'stream_id'"),
    ],
)
def test_a_malformed_client_message_is_refused_saying_why(text: str, says: str) -> None:
    with pytest.raises(BadRequestError) as refused:
        parse_client_message(text)
    assert says in str(refused.value)


def test_event_messages_carry_the_native_names_data_and_shared_ids() -> None:
    frames = WebSocketFrames(SID)
    batch = Batch(1, EVENTS)
    body = frames.body(batch)
    messages = [orjson.loads(m) for m in split_messages(body)]
    assert messages == [
        {"type": "event", "stream_id": SID, "id": f"{SID}:1", "event": "start",
         "data": {"model": "m", "created": 7}},
        {"type": "event", "stream_id": SID, "id": f"{SID}:2", "event": "token",
         "data": {"text": "a\nb"}},
        {"type": "event", "stream_id": SID, "id": f"{SID}:3", "event": "token",
         "data": {"text": ' "c"'}},
        {"type": "event", "stream_id": SID, "id": f"{SID}:4", "event": "usage",
         "data": {"prompt_tokens": 1, "completion_tokens": 2, "cached_tokens": 0}},
        {"type": "event", "stream_id": SID, "id": f"{SID}:5", "event": "done",
         "data": {"reason": "stop"}},
    ]  # fmt: skip
    assert b"".join(frames.frames(batch)) == body
    assert [m.count(b"\n") for m in frames.frames(batch)] == [1] * len(EVENTS)  # one each


def test_each_event_message_embeds_the_native_data_text_byte_for_byte() -> None:
    frames = WebSocketFrames(SID)
    events: list[NeutralEvent] = [*EVENTS, TextDelta("é 🙂 \\ \u2028")]
    for seq, event in enumerate(events, 1):
        name, data = native_message(event)
        expected = (
            f'{{"type":"event","stream_id":"{SID}","id":"{SID}:{seq}",'
            f'"event":"{name}","data":{data}}}\n'
        )
        assert frames.body(Batch(seq, (event,))) == expected.encode()


def test_merged_tokens_are_one_message_with_the_id_of_the_last() -> None:
    merged = WebSocketFrames(SID).merged_tokens("a b c", 9)
    assert merged is not None
    (message,) = split_messages(merged)
    assert orjson.loads(message) == {
        "type": "event", "stream_id": SID, "id": f"{SID}:9", "event": "token",
        "data": {"text": "a b c"},
    }  # fmt: skip


def test_refusals_and_answers_are_single_messages() -> None:
    (refusal,) = split_messages(WebSocketFrames(SID).refusal("resume_gap", "gone", 3))
    assert orjson.loads(refusal) == {
        "type": "error", "code": "resume_gap", "message": "gone", "stream_id": SID,
    }  # fmt: skip
    (error,) = split_messages(error_message("invalid_request", "bad"))
    assert orjson.loads(error) == {"type": "error", "code": "invalid_request", "message": "bad"}
    (created,) = split_messages(created_message({"id": SID}))
    assert orjson.loads(created) == {"type": "created", "stream": {"id": SID}}


def test_websocket_limits_refuse_a_queue_that_cannot_resume() -> None:
    with pytest.raises(ValueError, match="resume_queued_messages"):
        WebSocketLimits(max_queued_messages=10, resume_queued_messages=10)


def test_a_poll_query_defaults_to_the_start_and_the_default_hold() -> None:
    assert parse_poll_query({}, SID) == PollQuery(0, DEFAULT_POLL_TIMEOUT_S)
    assert parse_poll_query({"after": [""], "timeout_s": [""]}, SID) == PollQuery(
        0, DEFAULT_POLL_TIMEOUT_S
    )
    assert parse_poll_query({"after": [f"{SID}:12"], "timeout_s": ["0"]}, SID) == PollQuery(12, 0)
    assert parse_poll_query({"timeout_s": ["60"]}, SID).timeout_s == 60


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ({"after": ["12"]}, "after"),
        ({"after": [f"{SID}:1.2"]}, "after"),
        ({"after": ["str_" + "B" * 22 + ":1"]}, "after"),
        ({"after": [f"{SID}:01"]}, "after"),
        ({"timeout_s": ["60.5"]}, "timeout_s"),
        ({"timeout_s": ["-0.1"]}, "timeout_s"),
        ({"timeout_s": ["nan"]}, "timeout_s"),
        ({"timeout_s": ["inf"]}, "timeout_s"),
        ({"timeout_s": ["1s"]}, "timeout_s"),
    ],
)
def test_a_bad_poll_query_names_its_parameter(query: dict[str, list[str]], param: str) -> None:
    with pytest.raises(InvalidParameterError) as refused:
        parse_poll_query(query, SID)
    assert refused.value.param == param
    assert str(refused.value).startswith(f"{param}: ")


def test_a_poll_answer_is_json_with_the_events_their_ids_and_the_next_cursor() -> None:
    answer = orjson.loads(encode_poll(SID, Batch(3, EVENTS[1:3]), after_seq=2, done=False))
    assert answer == {
        "events": [
            {"id": f"{SID}:3", "event": "token", "data": {"text": "a\nb"}},
            {"id": f"{SID}:4", "event": "token", "data": {"text": ' "c"'}},
        ],
        "next": f"{SID}:4",
        "done": False,
    }
    end = orjson.loads(
        encode_poll(SID, Batch(5, (Error("x", "y\n", False),)), after_seq=4, done=True)
    )
    assert end["events"][0]["data"] == {"code": "x", "message": "y\n", "retryable": False}
    assert end["done"] is True


def test_an_empty_poll_answer_keeps_the_cursor() -> None:
    answer = orjson.loads(encode_poll(SID, Batch(8, ()), after_seq=7, done=False))
    assert answer == {"events": [], "next": f"{SID}:7", "done": False}


@pytest.mark.parametrize("size", [0, 1, 125, 126, 65_535, 65_536, 70_000])
def test_server_text_frames_are_websockets_own_bytes(size: int) -> None:
    """The sender frames messages itself (RFC 6455 section 5.2): byte for byte what
    ``websockets`` makes of an unmasked, unfragmented text frame with no extension, at
    each payload-length encoding's edges."""
    payload = ("é" * size).encode()[:size]
    frame = Frame(Opcode.TEXT, payload)
    assert server_text_frame(payload) == frame.serialize(mask=False, extensions=[])


def test_what_the_sender_reads_of_a_websockets_connection_is_there() -> None:
    """The adapter's sender frames by hand only on an open connection with no extension
    and no fragmented message under way: the three attributes it reads."""
    protocol = ServerProtocol()
    assert protocol.state is State.CONNECTING
    assert protocol.extensions == []
    assert protocol.expect_continuation_frame is False
    assert protocol.data_to_send() == []
