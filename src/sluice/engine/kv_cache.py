"""The paged KV cache: per-layer K and V tensors split into fixed-size physical blocks (torch).

Each layer holds ``k`` and ``v`` of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``.
A sequence's ``block_table`` maps its logical block ``i`` (positions
``i * block_size .. (i + 1) * block_size - 1``) to a physical block. Flattening the first two
dimensions gives ``num_blocks * block_size`` slots; the token at position ``pos`` lives in::

    slot = block_table[pos // block_size] * block_size + pos % block_size

Behind the blocks lies one extra slot, :attr:`KVCache.zero_slot`, that is never written
and stays zero: attention reads it in place of every key position past a sequence's
context, so stale (maybe NaN) K/V of a block's unused slots never reaches a softmax.

Which blocks a sequence owns is the block manager's business (pure Python); this module
only stores, writes and gathers. The cache never carries autograd history: written K and V
are detached.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["KVCache", "KVCacheError", "num_blocks_for", "slot_mapping"]


class KVCacheError(ValueError):
    """A block table, position or shape does not fit the cache."""


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """The number of blocks needed to hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


def slot_mapping(
    block_table: Sequence[int] | torch.Tensor, positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Flat slot index of each position of one sequence, given its block table.

    ``positions`` is a 1-D integer tensor of absolute token positions; the result is a
    ``long`` tensor of the same shape on the same device.
    """
    if block_size <= 0:
        raise KVCacheError(f"block_size must be positive, got {block_size}")
    table = torch.as_tensor(block_table, dtype=torch.long, device=positions.device)
    if table.dim() != 1:
        raise KVCacheError(f"block_table must be 1-D, got shape {tuple(table.shape)}")
    if positions.numel() == 0:
        return torch.empty(0, dtype=torch.long, device=positions.device)
    logical_blocks = positions.long() // block_size
    max_logical_block = int(logical_blocks.max())
    if int(positions.min()) < 0 or max_logical_block >= table.numel():
        raise KVCacheError(
            f"positions need {max_logical_block + 1} blocks, block_table has {table.numel()}"
        )
    return table[logical_blocks] * block_size + positions.long() % block_size


class KVCache:
    """Paged K and V storage for every layer of one model."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if value <= 0:
                raise KVCacheError(f"{name} must be positive, got {value}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # [num_slots + 1, heads, dim] per layer: every slot, then the zero slot.
        flat_shape = (num_blocks * block_size + 1, num_kv_heads, head_dim)
        self.flat_k: list[torch.Tensor] = [
            torch.zeros(flat_shape, dtype=dtype, device=device) for _ in range(num_layers)
        ]
        self.flat_v: list[torch.Tensor] = [
            torch.zeros(flat_shape, dtype=dtype, device=device) for _ in range(num_layers)
        ]
        # The blocks, as views of the same storage (the zero slot left out).
        self.k: list[torch.Tensor] = [flat[:-1].view(shape) for flat in self.flat_k]
        self.v: list[torch.Tensor] = [flat[:-1].view(shape) for flat in self.flat_v]

    @property
    def num_slots(self) -> int:
        """``num_blocks * block_size``: the length of the flattened slot dimension."""
        return self.num_blocks * self.block_size

    @property
    def zero_slot(self) -> int:
        """The index, in :attr:`flat_k` / :attr:`flat_v`, of the slot that stays zero."""
        return self.num_blocks * self.block_size

    def slot_mapping(
        self, block_table: Sequence[int] | torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """:func:`slot_mapping` with this cache's ``block_size``."""
        return slot_mapping(block_table, positions, self.block_size)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k`` and ``v`` (``[num_tokens, num_kv_heads, head_dim]``) at ``slots``."""
        self._check_layer(layer)
        expected = (slots.numel(), self.num_kv_heads, self.head_dim)
        if k.shape != expected or v.shape != expected:
            raise KVCacheError(
                f"k and v must have shape {expected}, got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        flat_k, flat_v = self.flat_k[layer], self.flat_v[layer]
        # Each conversion only where needed: this runs per layer and step.
        if slots.dtype != torch.long:
            slots = slots.long()
        if k.requires_grad or v.requires_grad:
            k, v = k.detach(), v.detach()
        if k.dtype != flat_k.dtype or v.dtype != flat_v.dtype:
            k, v = k.to(flat_k.dtype), v.to(flat_v.dtype)
        flat_k.index_copy_(0, slots, k)
        flat_v.index_copy_(0, slots, v)

    def gather(
        self, layer: int, block_table: Sequence[int] | torch.Tensor, context_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V for positions ``[0, context_len)``, each ``[context_len, heads, dim]``."""
        self._check_layer(layer)
        if context_len <= 0:
            raise KVCacheError(f"context_len must be positive, got {context_len}")
        num_context_blocks = num_blocks_for(context_len, self.block_size)
        table = torch.as_tensor(block_table, dtype=torch.long, device=self.k[layer].device)
        if table.dim() != 1 or table.numel() < num_context_blocks:
            raise KVCacheError(
                f"context_len {context_len} needs {num_context_blocks} blocks, "
                f"block_table has shape {tuple(table.shape)}"
            )
        blocks = table[:num_context_blocks]
        flat_shape = (num_context_blocks * self.block_size, self.num_kv_heads, self.head_dim)
        k = self.k[layer][blocks].reshape(flat_shape)[:context_len]
        v = self.v[layer][blocks].reshape(flat_shape)[:context_len]
        return k, v

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise KVCacheError(f"layer {layer} out of range [0, {self.num_layers})")
