"""What a log's records cost in memory: the estimate every byte bound of the logs counts.

A record is a neutral event (a frozen dataclass with its strings) held by the log, and,
beside it, what the delivery layer's frame cache keeps for it (its encoded SSE frame, a
``bytes``; see :class:`~sluice.streams.log.LogObserver`). The log counts
:func:`event_bytes` per event and the cache :func:`frame_bytes` per frame; both land in the
log's ``num_bytes``. Counting only ``len(frame)`` would undercount by about three: a
one-word token's frame is 72 bytes, but the record and its frame hold about 240.

The constants were measured on CPython 3.11 (64-bit) by holding a million records in two
lists and reading the process's RSS before and after (``tracemalloc`` reports requested
sizes, which pymalloc rounds up, so it says about 212 where RSS says 241):

============================  =========  ==========
token text                    estimate   RSS growth
============================  =========  ==========
``"a"`` (frame 72 bytes)      242        241
``"hello"``                   242        241
40 ASCII characters           306        306
``"ééééé"`` (Latin-1)         290        289
============================  =========  ==========

(event and native frame together). Both functions are called once per record on the hot
path, so a token's and a frame's are worked out without a call per object (they cost less
than encoding the frame). :func:`record_bytes` is their sum.
"""

from __future__ import annotations

import sys

from sluice.events import NeutralEvent, TextDelta

__all__ = ["LOG_BYTES", "event_bytes", "frame_bytes", "record_bytes"]

# A list slot: one pointer, plus the eighth a growing list over-allocates.
_SLOT_BYTES = 9
# pymalloc hands out blocks in steps of 16 bytes; objects over 512 bytes come from malloc,
# whose chunks carry a 16-byte header.
_ALIGNMENT = 16
_SMALL_OBJECT_BYTES = 512
_MALLOC_HEADER_BYTES = 16
# A one-slot frozen dataclass (``TextDelta``) is 40 bytes, in a 48-byte block.
_TEXT_DELTA_BYTES = 48
# ``sys.getsizeof("")`` and ``sys.getsizeof(b"")`` (an ASCII str, a bytes: header and NUL).
_ASCII_STR_BYTES = 49
_BYTES_BYTES = 33
# A token's record beside its text: the event and its list slot.
_TOKEN_BYTES = _TEXT_DELTA_BYTES + _SLOT_BYTES
# What one stream's log costs before its first record: its record object, two empty lists
# and its dict entry, and the frame cache's entry for the stream (an object, a list and a
# dict entry): about 450 bytes measured with tracemalloc, rounded up.
LOG_BYTES = 512


def _block(num_bytes: int) -> int:
    """The memory an object of ``num_bytes`` takes from the allocator."""
    if num_bytes > _SMALL_OBJECT_BYTES:
        num_bytes += _MALLOC_HEADER_BYTES
    return (num_bytes + _ALIGNMENT - 1) & -_ALIGNMENT


def event_bytes(event: NeutralEvent) -> int:
    """The memory a log's record of ``event`` holds: the object, its strings and its slot."""
    if type(event) is TextDelta:  # the hot path: one per token
        text = event.text
        size = _ASCII_STR_BYTES + len(text) if text.isascii() else sys.getsizeof(text)
        if size <= _SMALL_OBJECT_BYTES:
            return _TOKEN_BYTES + ((size + 15) & -16)
        return _TOKEN_BYTES + _block(size)
    total = _block(sys.getsizeof(event)) + _SLOT_BYTES
    for name in event.__slots__:
        value = getattr(event, name)
        # Strings, and ints but the small ones every int shares.
        if isinstance(value, str | bytes) or (type(value) is int and not -5 <= value <= 256):
            total += _block(sys.getsizeof(value))
    return total


def frame_bytes(frame: bytes) -> int:
    """The memory a cache's copy of one encoded frame holds, with its slot."""
    size = _BYTES_BYTES + len(frame)  # sys.getsizeof of a bytes, without the call
    if size <= _SMALL_OBJECT_BYTES:
        return _SLOT_BYTES + ((size + 15) & -16)
    return _SLOT_BYTES + _block(size)


def record_bytes(event: NeutralEvent, frame: bytes) -> int:
    """``event_bytes(event) + frame_bytes(frame)``: a record and the frame kept beside it."""
    return event_bytes(event) + frame_bytes(frame)
