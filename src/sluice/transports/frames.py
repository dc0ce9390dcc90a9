"""A stream's events as the SSE frames of its dialect, encoded once per event: the frame
cache of the delivery layer.

Every stream is read in one dialect: native, or the dialect it was created in (a
compatible stream resumes in its own, see :class:`~sluice.events.RenderMeta`). So the
cache keeps, per stream, one encoded blob per record: the SSE frames its event renders
to, joined, with their ids (:func:`encoder_for`). A fan-out of 1,000 readers of one
stream encodes each token once; no reader renders anything.

The cache is the log's observer (:class:`~sluice.streams.log.LogObserver`): it encodes in
the producer's append, before any reader wakes (the fast path of the fan-out, as when the
log itself held native frames), drops frames when the log trims, forgets a stream when its
log is deleted, and reports what it holds, so the log's bytes (and the hub's memory
budget) count the frames too (:func:`~sluice.streams.sizing.frame_bytes`).

Which encoder a stream gets: a stream the cache was told nothing about is encoded
natively (``POST /v1/streams``, the demo). The compatible API names its stream's encoder
(:meth:`FrameCache.encode_as`) right after creating it, before the producer's first
append, or says that it needs none (a ``"stream": false`` answer, read whole). A reader
of a stream with no cached frames (that rare whole answer read as SSE) gets its own
encoder (:class:`RenderedFrames`), which first replays the events before its position.

Ids: event ``n`` is ``<stream_id>:<n>`` on the last frame it renders to, frame ``k`` before
it ``<stream_id>:<n-1>.<k>`` (see :mod:`sluice.streams.ids`); a compatible stream that is
not resumable carries no ids.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Protocol

import orjson

from sluice.dialects.registry import NATIVE, dialect
from sluice.errors import BadEventIdError, ResumeGapError
from sluice.events import Error, NeutralEvent, Payload, RenderMeta, TextDelta
from sluice.sse import EventEncoder, encode_event
from sluice.streams.ids import event_id
from sluice.streams.log import Batch, EventLog
from sluice.streams.sizing import frame_bytes

__all__ = [
    "DialectEncoder",
    "FrameCache",
    "FrameEncoder",
    "FrameSource",
    "NativeEncoder",
    "PartlySent",
    "RenderedFrames",
    "encoder_for",
    "frame_source",
    "num_frames",
]

# Stateless (its meta is not read): one for every native stream.
_NATIVE_RENDERER = NATIVE.renderer(RenderMeta(NATIVE.name, "", "", 0, resumable=True))
# The native token frame, checked once (see sluice.dialects.native): the hot path.
_encode_token = EventEncoder("token")
_FRAME_END = b"\n\n"  # what ends every frame the encoders write (and nothing else does)


class FrameEncoder(Protocol):
    """One stream's events as SSE bytes, in order (a dialect's renderer is stateful)."""

    @property
    def retry_hint(self) -> bool:
        """Whether its responses open with a ``retry:`` hint (see
        :attr:`sluice.dialects.base.Dialect.retry_hint`)."""
        ...

    def encode(self, seq: int, event: NeutralEvent) -> bytes:
        """The frames of event ``seq`` (possibly none), joined."""
        ...

    def merged_tokens(self, text: str, seq: int) -> bytes | None:
        """One frame for a run of token events ending at ``seq`` whose texts join to
        ``text`` (coalescing), or ``None`` where the dialect cannot merge them."""
        ...

    def refusal(self, code: str, message: str, after_seq: int) -> bytes:
        """A terminal in-band error outside the log (``resume_gap``) for a reader whose
        position is ``after_seq``."""
        ...


class NativeEncoder:
    """The native dialect: one frame per event, each with its id (the registry's native
    renderer is stateless: one message per event, whatever came before)."""

    __slots__ = ("_prefix", "_stream_id")

    retry_hint = True  # EventSource reconnects by itself

    def __init__(self, stream_id: str) -> None:
        self._stream_id = stream_id
        self._prefix = stream_id + ":"

    def encode(self, seq: int, event: NeutralEvent) -> bytes:
        if type(event) is TextDelta:  # the hot path: one per token
            return _encode_token(
                orjson.dumps({"text": event.text}).decode(), f"{self._prefix}{seq}"
            )
        return _native_frame(event, f"{self._prefix}{seq}")

    def merged_tokens(self, text: str, seq: int) -> bytes | None:
        return self.encode(seq, TextDelta(text))

    def refusal(self, code: str, message: str, after_seq: int) -> bytes:
        # With the id of the reader's position: its reconnect names it and gets a 410.
        error = Error(code, message, retryable=False)
        return _native_frame(error, event_id(self._stream_id, after_seq))


def _native_frame(event: NeutralEvent, id: str) -> bytes:
    """The native frame of ``event`` with SSE id ``id``."""
    ((name, data),) = _NATIVE_RENDERER.render(event)
    return encode_event(data, event=name, id=id)


class DialectEncoder:
    """A dialect of the registry: its renderer's messages as SSE frames."""

    __slots__ = ("_meta", "_renderer", "_stream_id")

    def __init__(self, meta: RenderMeta, stream_id: str) -> None:
        self._meta = meta
        self._renderer = dialect(meta.dialect).renderer(meta)
        self._stream_id = stream_id if meta.resumable else None

    @property
    def retry_hint(self) -> bool:
        return dialect(self._meta.dialect).retry_hint

    def encode(self, seq: int, event: NeutralEvent) -> bytes:
        messages = self._renderer.render(event)
        stream_id = self._stream_id
        if stream_id is None:
            return b"".join(encode_event(data, event=name) for name, data in messages)
        last = len(messages) - 1
        return b"".join(
            encode_event(
                data,
                event=name,
                id=f"{stream_id}:{seq}" if i == last else f"{stream_id}:{seq - 1}.{i + 1}",
            )
            for i, (name, data) in enumerate(messages)
        )

    def merged_tokens(self, text: str, seq: int) -> bytes | None:
        return None  # its renderer is stateful: a merged delta would be rendered out of place

    def refusal(self, code: str, message: str, after_seq: int) -> bytes:
        renderer = dialect(self._meta.dialect).renderer(self._meta)
        messages = renderer.render(Error(code, message, retryable=False))[-1:]
        return b"".join(encode_event(data, event=name) for name, data in messages)


def encoder_for(meta: RenderMeta | None, stream_id: str) -> FrameEncoder:
    """The encoder of a stream created in ``meta``'s dialect (``None``: native)."""
    if meta is None or meta.dialect == NATIVE.name:
        return NativeEncoder(stream_id)
    return DialectEncoder(meta, stream_id)


class FrameSource(Protocol):
    """A reader's frames: what the delivery core writes for the records it reads."""

    @property
    def retry_hint(self) -> bool: ...

    def body(self, batch: Batch) -> bytes:
        """The frames of ``batch``'s events, joined."""
        ...

    def frames(self, batch: Batch) -> Sequence[bytes]:
        """The frames of each of ``batch``'s events (for coalescing)."""
        ...

    def merged_tokens(self, text: str, seq: int) -> bytes | None: ...

    def refusal(self, code: str, message: str, after_seq: int) -> bytes: ...


class _Frames:
    """One stream's cached frames: ``encoded[i]`` is record ``first_seq + i``'s. It is the
    :class:`FrameSource` of every reader of the stream (no object per reader)."""

    __slots__ = ("encoded", "encoder", "first_seq")

    def __init__(self, encoder: FrameEncoder, first_seq: int = 1) -> None:
        self.encoder = encoder
        self.first_seq = first_seq
        self.encoded: list[bytes] = []

    @property
    def retry_hint(self) -> bool:
        return self.encoder.retry_hint

    def body(self, batch: Batch) -> bytes:
        start = batch.first_seq - self.first_seq
        count = len(batch.events)
        if count == 1:
            return self.encoded[start]
        return b"".join(self.encoded[start : start + count])

    def frames(self, batch: Batch) -> Sequence[bytes]:
        start = batch.first_seq - self.first_seq
        return self.encoded[start : start + len(batch.events)]

    def merged_tokens(self, text: str, seq: int) -> bytes | None:
        return self.encoder.merged_tokens(text, seq)

    def refusal(self, code: str, message: str, after_seq: int) -> bytes:
        return self.encoder.refusal(code, message, after_seq)


class FrameCache:
    """Every stream's encoded frames; the log's :class:`~sluice.streams.log.LogObserver`."""

    __slots__ = ("_streams", "_unencoded")

    def __init__(self) -> None:
        self._streams: dict[str, _Frames] = {}
        self._unencoded: set[str] = set()  # streams read whole: nothing to encode

    def __len__(self) -> int:
        return len(self._streams)

    def encode_as(self, stream_id: str, encoder: FrameEncoder | None) -> None:
        """Encode the stream's records with ``encoder`` (``None``: keep no frames for it).
        Call before the stream's first record is appended."""
        entry = self._streams.get(stream_id)
        if entry is not None and entry.encoded:
            raise RuntimeError(f"stream {stream_id} already has frames of another encoder")
        if encoder is None:
            self._streams.pop(stream_id, None)
            self._unencoded.add(stream_id)
        else:
            self._unencoded.discard(stream_id)
            self._streams[stream_id] = _Frames(encoder)

    def source(self, stream_id: str, log: EventLog) -> FrameSource | None:
        """The stream's cached frames as a reader's source; ``None`` when the cache keeps
        none for it (its records were appended without it: read whole)."""
        entry = self._streams.get(stream_id)
        if entry is None:
            if stream_id in self._unencoded or log.last_seq(stream_id) > 0:
                return None
            # Nothing appended yet (a reader that came before the first event): the
            # native entry its first append would have made.
            entry = self._streams[stream_id] = _Frames(NativeEncoder(stream_id))
        return entry

    # -- the LogObserver protocol ------------------------------------------------------

    def appended(self, stream_id: str, first_seq: int, events: Sequence[NeutralEvent]) -> int:
        entry = self._streams.get(stream_id)
        if entry is None:
            if stream_id in self._unencoded:
                return 0
            if events and type(events[0]) is Payload:  # a durable stream's: read as is
                self._unencoded.add(stream_id)
                return 0
            entry = self._streams[stream_id] = _Frames(NativeEncoder(stream_id), first_seq)
        frames = entry.encoded
        encode = entry.encoder.encode
        num_bytes = 0
        seq = first_seq
        for event in events:
            frame = encode(seq, event)
            frames.append(frame)
            num_bytes += frame_bytes(frame)
            seq += 1
        return num_bytes

    def record_bytes(self, stream_id: str, seq: int) -> int:
        entry = self._streams.get(stream_id)
        if entry is None:
            return 0
        return frame_bytes(entry.encoded[seq - entry.first_seq])

    def trimmed(self, stream_id: str, first_seq: int) -> None:
        entry = self._streams.get(stream_id)
        if entry is not None:
            del entry.encoded[: first_seq - entry.first_seq]
            entry.first_seq = first_seq

    def deleted(self, stream_id: str) -> None:
        self._streams.pop(stream_id, None)
        self._unencoded.discard(stream_id)


class RenderedFrames:
    """A reader's own encoder, for a stream the cache keeps no frames for: its events are
    encoded as the reader reads them (the encoder first replayed the ones before)."""

    __slots__ = ("_encoder", "_pending")

    def __init__(self, encoder: FrameEncoder) -> None:
        self._encoder = encoder
        self._pending: tuple[int, bytes] | None = None  # an event rendered ahead of its read

    @property
    def retry_hint(self) -> bool:
        return self._encoder.retry_hint

    def render_ahead(self, batch: Batch) -> bytes:
        """The frames of ``batch``'s first event, rendered now and served as rendered when
        the reader reads it (a stateful renderer must see each event once)."""
        frame = self._encoder.encode(batch.first_seq, batch.events[0])
        self._pending = (batch.first_seq, frame)
        return frame

    def body(self, batch: Batch) -> bytes:
        return b"".join(self.frames(batch))

    def frames(self, batch: Batch) -> Sequence[bytes]:
        encode = self._encoder.encode
        frames = []
        pending, self._pending = self._pending, None
        for i, event in enumerate(batch.events):
            seq = batch.first_seq + i
            if pending is not None and pending[0] == seq:
                frames.append(pending[1])
            else:
                frames.append(encode(seq, event))
        return frames

    def merged_tokens(self, text: str, seq: int) -> bytes | None:
        return self._encoder.merged_tokens(text, seq)

    def refusal(self, code: str, message: str, after_seq: int) -> bytes:
        return self._encoder.refusal(code, message, after_seq)


class PartlySent:
    """A source whose first event, ``seq``, the client already has the first ``skip``
    frames of (it resumed from the frame id ``<seq-1>.<skip>``): those are left out."""

    __slots__ = ("_seq", "_skip", "_source")

    def __init__(self, source: FrameSource, seq: int, skip: int) -> None:
        self._source = source
        self._seq = seq
        self._skip = skip

    @property
    def retry_hint(self) -> bool:
        return self._source.retry_hint

    def body(self, batch: Batch) -> bytes:
        if not self._skip:
            return self._source.body(batch)
        return b"".join(self.frames(batch))

    def frames(self, batch: Batch) -> Sequence[bytes]:
        frames = self._source.frames(batch)
        if self._skip and batch.events and batch.first_seq == self._seq:
            first = _FRAME_END.join(frames[0].split(_FRAME_END)[self._skip : -1])
            frames = [first + _FRAME_END if first else b"", *frames[1:]]
            self._skip = 0
        return frames

    def merged_tokens(self, text: str, seq: int) -> bytes | None:
        return self._source.merged_tokens(text, seq)

    def refusal(self, code: str, message: str, after_seq: int) -> bytes:
        return self._source.refusal(code, message, after_seq)


def num_frames(blob: bytes) -> int:
    """How many frames a joined blob of the encoders holds."""
    return blob.count(_FRAME_END)


def frame_source(
    cache: FrameCache,
    log: EventLog,
    stream_id: str,
    meta: RenderMeta | None,
    after_seq: int,
    skip: int = 0,
) -> FrameSource:
    """The frames of a reader of ``stream_id`` that starts after event ``after_seq``, and
    ``skip`` frames of the next one.

    Cached frames where the cache has them; else a reader's own encoder, which first
    replays events ``1 .. after_seq`` (a dialect's frames depend on what came before; if
    those are gone, the reader's own read meets the resume gap). A ``skip`` that leaves none
    of the next event's frames (the client names a frame id ``<after_seq>.<skip>`` that was
    never sent) raises :class:`~sluice.errors.BadEventIdError` (a 400, before any response).
    """
    source = cache.source(stream_id, log)
    if source is None:
        encoder = encoder_for(meta, stream_id)
        seq = 0
        with contextlib.suppress(ResumeGapError):
            while seq < after_seq:
                batch = log.read(stream_id, seq, after_seq - seq)
                if not batch.events:
                    break
                for offset, event in enumerate(batch.events):
                    encoder.encode(batch.first_seq + offset, event)
                seq = batch.last_seq
        source = RenderedFrames(encoder)
    if not skip:
        return source
    try:
        batch = log.read(stream_id, after_seq, 1)
    except ResumeGapError:
        return source  # the reader's own read reports the gap
    count = 0
    if batch.events:
        if isinstance(source, RenderedFrames):
            count = num_frames(source.render_ahead(batch))
        else:
            count = num_frames(source.body(batch))
    # Frame k (from 1) of an event is sent as "<after_seq>.<k>" for k below its count;
    # its last frame carries the event's own id.
    if skip >= count:
        raise BadEventIdError(
            f"Last-Event-ID names frame {skip} of event {after_seq + 1} of stream "
            f"{stream_id}, which has {max(count - 1, 0)} frame ids before its own"
        )
    return PartlySent(source, after_seq + 1, skip)
