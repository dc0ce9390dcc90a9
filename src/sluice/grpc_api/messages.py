"""Neutral events as ``sluice.v1.StreamEvent`` messages: the gRPC front's frames.

:class:`GrpcFrames` is the delivery core's :class:`~sluice.transports.frames.FrameSource`
for one gRPC reader. The core joins a batch's frames into one body; each frame here is a
serialized ``StreamEvent`` behind a 4-byte big-endian length, so the shell
(:func:`split_frames`) writes each as its own gRPC message, already serialized. Event
names, ids and payload fields are the native SSE dialect's (:mod:`sluice.dialects.native`):
``<stream_id>:<n>`` ids, so a cursor from one transport resumes on another.
"""

from __future__ import annotations

from collections.abc import Sequence

from sluice.events import (
    Error,
    Finished,
    NeutralEvent,
    Started,
    TextDelta,
    ToolCallDelta,
    Usage,
)
from sluice.grpc_api import streams_pb2 as pb
from sluice.streams.ids import event_id
from sluice.streams.log import Batch

__all__ = ["GrpcFrames", "split_frames", "stream_event"]

_LENGTH_BYTES = 4


def stream_event(event: NeutralEvent, id: str) -> pb.StreamEvent:
    """``event`` as the message with id ``id``."""
    if isinstance(event, TextDelta):  # first: one per token
        return pb.StreamEvent(id=id, event="token", token=pb.Token(text=event.text))
    if isinstance(event, Started):
        return pb.StreamEvent(
            id=id, event="start", start=pb.Started(model=event.model, created=event.created)
        )
    if isinstance(event, ToolCallDelta):
        call = pb.ToolCall(index=event.index, arguments=event.arguments_delta)
        if event.id is not None:
            call.id = event.id
        if event.name is not None:
            call.name = event.name
        return pb.StreamEvent(id=id, event="tool_call", tool_call=call)
    if isinstance(event, Usage):
        usage = pb.Usage(
            prompt_tokens=event.prompt_tokens,
            completion_tokens=event.completion_tokens,
            cached_tokens=event.cached_tokens,
        )
        return pb.StreamEvent(id=id, event="usage", usage=usage)
    if isinstance(event, Finished):
        return pb.StreamEvent(id=id, event="done", done=pb.Done(reason=event.reason.value))
    if isinstance(event, Error):
        error = pb.Error(code=event.type, message=event.message, retryable=event.retryable)
        return pb.StreamEvent(id=id, event="error", error=error)
    raise TypeError(f"no StreamEvent for {type(event).__name__}")


def _frame(message: pb.StreamEvent) -> bytes:
    data = message.SerializeToString()
    return len(data).to_bytes(_LENGTH_BYTES, "big") + data


def split_frames(body: bytes) -> list[bytes]:
    """The serialized messages of a body :class:`GrpcFrames` joined."""
    messages: list[bytes] = []
    pos = 0
    while pos < len(body):
        size = int.from_bytes(body[pos : pos + _LENGTH_BYTES], "big")
        pos += _LENGTH_BYTES
        messages.append(body[pos : pos + size])
        pos += size
    return messages


class GrpcFrames:
    """One reader's events as framed ``StreamEvent`` messages (encoded per reader: a gRPC
    stream has one reader, and the frame cache holds SSE frames)."""

    __slots__ = ("_stream_id",)

    retry_hint = False  # a gRPC client resumes with Watch

    def __init__(self, stream_id: str) -> None:
        self._stream_id = stream_id

    def body(self, batch: Batch) -> bytes:
        return b"".join(self.frames(batch))

    def frames(self, batch: Batch) -> Sequence[bytes]:
        stream_id, first_seq = self._stream_id, batch.first_seq
        return [
            _frame(stream_event(event, event_id(stream_id, first_seq + i)))
            for i, event in enumerate(batch.events)
        ]

    def merged_tokens(self, text: str, seq: int) -> bytes | None:
        return _frame(stream_event(TextDelta(text), event_id(self._stream_id, seq)))

    def refusal(self, code: str, message: str, after_seq: int) -> bytes:
        # With the id of the reader's position, as the native dialect's refusal.
        error = Error(code, message, retryable=False)
        return _frame(stream_event(error, event_id(self._stream_id, after_seq)))
