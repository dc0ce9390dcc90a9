"""How streams look in Redis: key names, and neutral events and stream records as bytes.

Keys of one stream share the hash tag ``{<stream_id>}``, so in a Redis Cluster they live in
one slot and a Lua script may touch them together:

=============================  ==========================================================
``sluice:{id}:log``            the Redis stream of events; entry ``0-<seq>`` is event
                               ``seq`` (field ``e``; a terminal event also has ``t``)
``sluice:{id}:meta``           hash: the stream's record (:func:`encode_record`) and state
``sluice:{id}:events``         pub/sub channel: every append, for replicas that follow it
=============================  ==========================================================

and the registry's keys, which share the hash tag ``{registry}`` (one slot, deliberately:
admission counts a stream against the server's and its tenant's limits in one atomic
script, and they are touched once per stream created or ended and once per heartbeat,
never per token):

=========================================  ===============================================
``sluice:{registry}:leases``               sorted set: stream id -> producer lease expiry
                                           (ms)
``sluice:{registry}:live``                 set of live stream ids (``--max-streams``)
``sluice:{registry}:tenant:<t>:live``      set of a tenant's live stream ids
``sluice:{registry}:log-bytes``            the live streams' log bytes, all tenants
                                           (``--log-memory-budget``)
``sluice:{registry}:tenant-log-bytes``     hash: tenant -> its live streams' log bytes
=========================================  ===============================================

and ``sluice:replica:<id>`` (a replica's liveness, with a TTL) and
``sluice:replica:<id>:control`` (its cancel bus channel).

An event is a compact JSON array, its first item a one-letter tag (a durable stream's
``Payload`` bytes in base64); a published append is
the seq of its first event, a space, then a JSON array of such arrays. No wire format of a
client is stored: each replica renders events itself.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence

import orjson

from sluice.events import (
    Error,
    Finished,
    FinishReason,
    NeutralEvent,
    Payload,
    RenderMeta,
    Started,
    TextDelta,
    ToolCallDelta,
    Usage,
)

__all__ = [
    "LEASES_KEY",
    "LIVE_KEY",
    "LOG_BYTES_KEY",
    "TENANT_LOG_BYTES_KEY",
    "decode_append",
    "decode_event",
    "decode_render",
    "encode_append",
    "encode_event",
    "encode_render",
    "entry_id",
    "entry_seq",
    "events_channel",
    "log_key",
    "meta_key",
    "replica_control_channel",
    "replica_key",
    "tenant_live_key",
]

LEASES_KEY = "sluice:{registry}:leases"
LIVE_KEY = "sluice:{registry}:live"
LOG_BYTES_KEY = "sluice:{registry}:log-bytes"
TENANT_LOG_BYTES_KEY = "sluice:{registry}:tenant-log-bytes"


def log_key(stream_id: str) -> str:
    return f"sluice:{{{stream_id}}}:log"


def meta_key(stream_id: str) -> str:
    return f"sluice:{{{stream_id}}}:meta"


def events_channel(stream_id: str) -> str:
    return f"sluice:{{{stream_id}}}:events"


def tenant_live_key(tenant: str) -> str:
    return f"sluice:{{registry}}:tenant:{tenant}:live"


def replica_key(replica_id: str) -> str:
    return f"sluice:replica:{replica_id}"


def replica_control_channel(replica_id: str) -> str:
    return f"sluice:replica:{replica_id}:control"


def entry_id(seq: int) -> str:
    """The Redis stream entry id of event ``seq``: explicit, so ids and seqs are one."""
    return f"0-{seq}"


def entry_seq(entry: bytes | str) -> int:
    text = entry.decode() if isinstance(entry, bytes) else entry
    return int(text.partition("-")[2])


def _event_item(event: NeutralEvent) -> list[object]:
    match event:
        case TextDelta(text):
            return ["t", text]
        case Started(model, created, prompt_tokens):
            return ["s", model, created, prompt_tokens]
        case ToolCallDelta(index, arguments_delta, call_id, name):
            return ["c", index, arguments_delta, call_id, name]
        case Usage(prompt_tokens, completion_tokens, cached_tokens):
            return ["u", prompt_tokens, completion_tokens, cached_tokens]
        case Finished(reason, stop_sequence):
            return ["f", reason.value, stop_sequence]
        case Error(error_type, message, retryable):
            return ["e", error_type, message, retryable]
        case Payload(data, num_messages):  # a durable stream's append: any bytes
            return ["p", base64.b64encode(data).decode("ascii"), num_messages]
    raise TypeError(f"not a neutral event: {event!r}")  # pragma: no cover


def _item_event(item: Sequence[object]) -> NeutralEvent:
    tag = item[0]
    if tag == "t":
        return TextDelta(str(item[1]))
    if tag == "s":
        return Started(str(item[1]), int(str(item[2])), int(str(item[3])))
    if tag == "c":
        call_id, name = item[3], item[4]
        return ToolCallDelta(
            int(str(item[1])),
            str(item[2]),
            None if call_id is None else str(call_id),
            None if name is None else str(name),
        )
    if tag == "u":
        return Usage(int(str(item[1])), int(str(item[2])), int(str(item[3])))
    if tag == "f":
        stop = item[2]
        return Finished(FinishReason(str(item[1])), None if stop is None else str(stop))
    if tag == "e":
        return Error(str(item[1]), str(item[2]), bool(item[3]))
    if tag == "p":
        return Payload(base64.b64decode(str(item[1])), int(str(item[2])))
    raise ValueError(f"unknown event tag {tag!r}")


def encode_event(event: NeutralEvent) -> bytes:
    if type(event) is TextDelta:  # nearly every event: no match statement, one dumps
        return b'["t",%s]' % orjson.dumps(event.text)
    return orjson.dumps(_event_item(event))


def decode_event(data: bytes) -> NeutralEvent:
    item = orjson.loads(data)
    if not isinstance(item, list) or not item:
        raise ValueError("an event is a non-empty JSON array")
    return _item_event(item)


def encode_append(first_seq: int, encoded: Sequence[bytes]) -> bytes:
    """One published append: ``<first_seq> [event, ...]`` from already encoded events."""
    return b"%d [%s]" % (first_seq, b",".join(encoded))


def decode_append(data: bytes) -> tuple[int, list[NeutralEvent]]:
    head, _, body = data.partition(b" ")
    items = orjson.loads(body)
    if not isinstance(items, list):
        raise ValueError("an append is a JSON array of events")
    return int(head), [_item_event(item) for item in items]


def encode_render(meta: RenderMeta | None) -> bytes:
    if meta is None:
        return b""
    return orjson.dumps(
        [
            meta.dialect,
            meta.response_id,
            meta.model,
            meta.created,
            meta.resumable,
            meta.include_usage,
            [list(pair) for pair in meta.options],
        ]
    )


def decode_render(data: bytes) -> RenderMeta | None:
    if not data:
        return None
    item = orjson.loads(data)
    options = tuple((str(k), str(v)) for k, v in item[6])
    return RenderMeta(
        str(item[0]),
        str(item[1]),
        str(item[2]),
        int(item[3]),
        bool(item[4]),
        bool(item[5]),
        options,
    )


def text_fields(fields: Mapping[bytes, bytes]) -> dict[str, str]:
    """A hash read from Redis (bytes both sides) as text, except ``render``."""
    return {key.decode(): value.decode() for key, value in fields.items() if key != b"render"}
