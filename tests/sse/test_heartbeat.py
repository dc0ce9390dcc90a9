"""Heartbeats are invisible to every SSE parser: ours, a browser's rules (WHATWG HTML
§9.2.6) and the Stainless ``SSEDecoder`` of the ``openai`` and ``anthropic`` Python SDKs,
which dispatches an event on every blank line once an ``id`` was seen.

The bytes are the transports' own: the ``retry:`` block, frames with ids, and the
heartbeat written between them, directly after the ``retry:`` block, twice in a row, and
last (a stream cut while idle). Each parser reads them whole and one byte at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from anthropic._streaming import SSEDecoder as AnthropicDecoder
from openai._streaming import SSEDecoder as OpenAIDecoder

from sluice.sse import Decoder, Event, encode_event, encode_retry
from sluice.transports.delivery import PING as _PING

FRAMES = [
    encode_event('{"n":1}', event="token", id="str_x:1"),
    encode_event('{"n":2}', id="str_x:2"),
    encode_event("[DONE]", id="str_x:3"),
]
STREAM = (
    encode_retry(1000) + _PING + FRAMES[0] + _PING + _PING + FRAMES[1] + _PING + FRAMES[2] + _PING
)
EXPECTED = [
    ("token", '{"n":1}', "str_x:1"),
    ("message", '{"n":2}', "str_x:2"),
    ("message", "[DONE]", "str_x:3"),
]

Split = Callable[[bytes], Iterator[bytes]]


def whole(stream: bytes) -> Iterator[bytes]:
    yield stream


def bytewise(stream: bytes) -> Iterator[bytes]:
    for index in range(len(stream)):
        yield stream[index : index + 1]


splits = pytest.mark.parametrize("split", [whole, bytewise], ids=["whole", "bytewise"])


def test_the_heartbeat_is_a_bare_comment_line() -> None:
    assert _PING == b": ping\n"


@splits
def test_our_decoder_reads_only_the_frames(split: Split) -> None:
    decoder = Decoder()
    events: list[Event] = []
    for chunk in split(STREAM):
        events += decoder.feed(chunk)
    events += decoder.close()
    assert [(e.event, e.data, e.id) for e in events] == EXPECTED
    assert decoder.retry_ms == 1000


@splits
@pytest.mark.parametrize(
    "sdk_decoder", [OpenAIDecoder, AnthropicDecoder], ids=["openai", "anthropic"]
)
def test_the_sdk_decoders_read_only_the_frames(
    split: Split, sdk_decoder: type[OpenAIDecoder] | type[AnthropicDecoder]
) -> None:
    events = list(sdk_decoder().iter_bytes(split(STREAM)))
    # The retry block is an event of its own in these decoders (why compatible streams get
    # no retry hint); every other event is a frame, none has empty data.
    assert [(e.retry, e.data) for e in events[:1]] == [(1000, "")]
    assert [(e.event or "message", e.data, e.id) for e in events[1:]] == EXPECTED
