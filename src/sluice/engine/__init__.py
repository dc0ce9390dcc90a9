"""Engine logic that needs no accelerator: sequences, the KV-cache block manager, the scheduler,
speculation's plan (prompt lookup, adaptive k).

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
from sluice.engine.speculative import (
    AdaptiveK,
    SpecDecodeStats,
    SpeculativeConfig,
    propose_ngram,
)

__all__ = [
    "AdaptiveK",
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
    "SpecDecodeStats",
    "SpeculativeConfig",
    "StepOrderError",
    "compute_block_hash",
    "propose_ngram",
]
