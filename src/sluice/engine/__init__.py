"""Engine logic that needs no accelerator: sequences, the KV-cache block manager, the scheduler.

Pure Python, self-contained (imports nothing else from ``sluice``), tested on the CPU.
"""

from __future__ import annotations

from sluice.engine.block_manager import (
    Block,
    BlockAllocationError,
    BlockHashFn,
    BlockManager,
    BlockManagerError,
    BlockManagerStats,
    BlockTableError,
    compute_block_hash,
)
from sluice.engine.scheduler import (
    QueueFullError,
    ScheduledBatch,
    ScheduledSequence,
    Scheduler,
    SchedulerConfig,
    SchedulerError,
    StepOrderError,
)
from sluice.engine.sequence import Sequence, SequenceStatus

__all__ = [
    "Block",
    "BlockAllocationError",
    "BlockHashFn",
    "BlockManager",
    "BlockManagerError",
    "BlockManagerStats",
    "BlockTableError",
    "QueueFullError",
    "ScheduledBatch",
    "ScheduledSequence",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerError",
    "Sequence",
    "SequenceStatus",
    "StepOrderError",
    "compute_block_hash",
]
