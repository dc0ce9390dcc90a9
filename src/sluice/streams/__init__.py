"""Streams: the hub, the event log seam and its in-memory implementation."""

from sluice.streams.hub import HubSettings, Stream, StreamHub
from sluice.streams.log import Batch, EventLog, LogLimits
from sluice.streams.memory import MemoryEventLog
from sluice.streams.reader import Reader
from sluice.streams.state import StreamState

__all__ = [
    "Batch",
    "EventLog",
    "HubSettings",
    "LogLimits",
    "MemoryEventLog",
    "Reader",
    "Stream",
    "StreamHub",
    "StreamState",
]
