"""Engine logic that needs no accelerator: sequences and the paged KV-cache block manager.

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
from sluice.engine.sequence import Sequence, SequenceStatus

__all__ = [
    "Block",
    "BlockAllocationError",
    "BlockHashFn",
    "BlockManager",
    "BlockManagerError",
    "BlockManagerStats",
    "BlockTableError",
    "Sequence",
    "SequenceStatus",
    "compute_block_hash",
]
