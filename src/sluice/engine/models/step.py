"""One engine step's packed inputs, shared by every model: which tokens belong to which
sequence, where their K/V go in the paged cache, and the checks that they fit together."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sluice.engine.kv_cache import KVCache, num_blocks_for

__all__ = [
    "DecodeBatch",
    "StepError",
    "StepLayout",
    "StepSequence",
    "begin_step",
    "last_token_indices",
    "packed_slots",
    "paged_attention",
]


class StepError(ValueError):
    """The packed inputs of a step do not fit together (shapes, slices or block tables)."""


@dataclass(frozen=True)
class StepSequence:
    """One sequence's share of a step's packed tokens.

    ``input_ids[start : start + num_new_tokens]`` are its new tokens; ``context_len`` counts
    the tokens in the cache after this step, new ones included, so the new tokens sit at
    positions ``context_len - num_new_tokens .. context_len - 1``. ``block_table`` must
    cover ``context_len`` positions.
    """

    start: int
    num_new_tokens: int
    context_len: int
    block_table: Sequence[int]

    def __post_init__(self) -> None:
        if self.start < 0:
            raise StepError(f"start must be >= 0, got {self.start}")
        if self.num_new_tokens <= 0:
            raise StepError(f"num_new_tokens must be positive, got {self.num_new_tokens}")
        if self.context_len < self.num_new_tokens:
            raise StepError(
                f"context_len {self.context_len} < num_new_tokens {self.num_new_tokens}"
            )

    @property
    def end(self) -> int:
        """One past the index of its last new token in the packed inputs."""
        return self.start + self.num_new_tokens


def begin_step(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    seqs: Sequence[StepSequence],
    kv_cache: KVCache,
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    max_positions: int,
) -> StepLayout:
    """Lay a step out for every layer, raising :class:`StepError` unless its inputs fit
    the model and the cache."""
    if input_ids.dim() != 1 or positions.shape != input_ids.shape:
        raise StepError(
            f"input_ids and positions must be 1-D and equal in shape, got "
            f"{tuple(input_ids.shape)} and {tuple(positions.shape)}"
        )
    if not seqs:
        raise StepError("a step needs at least one sequence")
    if kv_cache.num_layers != num_layers:
        raise StepError(f"kv_cache has {kv_cache.num_layers} layers, model has {num_layers}")
    if (kv_cache.num_kv_heads, kv_cache.head_dim) != (num_kv_heads, head_dim):
        raise StepError(
            f"kv_cache holds {kv_cache.num_kv_heads} heads of dim {kv_cache.head_dim}, "
            f"model needs {num_kv_heads} of dim {head_dim}"
        )
    num_packed_tokens = 0
    for index, seq in enumerate(seqs):
        if seq.start != num_packed_tokens:
            raise StepError(f"sequence {index} starts at {seq.start}, expected {num_packed_tokens}")
        if seq.context_len > max_positions:
            raise StepError(
                f"sequence {index} context_len {seq.context_len} exceeds the model's "
                f"{max_positions} positions"
            )
        num_needed_blocks = num_blocks_for(seq.context_len, kv_cache.block_size)
        if len(seq.block_table) < num_needed_blocks:
            raise StepError(
                f"sequence {index} needs {num_needed_blocks} blocks for context_len "
                f"{seq.context_len}, block_table has {len(seq.block_table)}"
            )
        num_packed_tokens = seq.end
    if num_packed_tokens != input_ids.shape[0]:
        raise StepError(
            f"sequences cover {num_packed_tokens} tokens, input_ids has {input_ids.shape[0]}"
        )
    return StepLayout.of(seqs, positions, kv_cache)


def packed_slots(
    positions: torch.Tensor, seqs: Sequence[StepSequence], kv_cache: KVCache
) -> torch.Tensor:
    """The cache slot of every packed token, through its sequence's block table."""
    return torch.cat(
        [kv_cache.slot_mapping(seq.block_table, positions[seq.start : seq.end]) for seq in seqs]
    )


def last_token_indices(seqs: Sequence[StepSequence], device: torch.device) -> torch.Tensor:
    """The packed index of each sequence's last new token (where its logits come from)."""
    return torch.tensor([seq.end - 1 for seq in seqs], device=device)


@dataclass(frozen=True)
class DecodeBatch:
    """The decoding sequences of a step, attended in one call."""

    rows: torch.Tensor  # packed index of each one's new token
    tables: torch.Tensor  # [num_decodes, max_blocks] block tables, padded with block 0
    mask: torch.Tensor  # [num_decodes, 1, 1, max_context]: key position < context_len
    # [num_decodes, 1, max_context, 1]: the masked key slots, zeroed before attending. They
    # hold stale KV (block 0, a last block's unwritten slots), maybe NaN from a request that
    # failed, and a masked NaN still turns the whole output into NaN.
    padding: torch.Tensor


@dataclass(frozen=True)
class StepLayout:
    """How one step's packed tokens attend, worked out once per step for every layer.

    Decoding sequences (one new token each) attend in ONE batched call: their block tables
    padded to ``[num_decodes, max_blocks]`` gather their keys and values at once, and a
    mask hides each one's padding. Sequences with several new tokens (prefill chunks)
    attend one by one, each with its causal mask. Mixing both in one padded batch would
    pad every decode to the longest chunk.
    """

    seqs: Sequence[StepSequence]
    positions: torch.Tensor
    slots: torch.Tensor  # the cache slot of every packed token
    decodes: DecodeBatch | None
    chunks: tuple[StepSequence, ...]

    @classmethod
    def of(
        cls, seqs: Sequence[StepSequence], positions: torch.Tensor, kv_cache: KVCache
    ) -> StepLayout:
        device = positions.device
        block_size = kv_cache.block_size
        slots = packed_slots(positions, seqs, kv_cache)
        decodes = [seq for seq in seqs if seq.num_new_tokens == 1]
        chunks = tuple(seq for seq in seqs if seq.num_new_tokens > 1)
        if len(decodes) < 2:  # nothing to batch: every sequence attends alone
            return cls(seqs, positions, slots, None, tuple(seqs))
        max_context = max(seq.context_len for seq in decodes)
        max_blocks = num_blocks_for(max_context, block_size)
        tables = torch.zeros((len(decodes), max_blocks), dtype=torch.long)
        for row, seq in enumerate(decodes):
            num_blocks = num_blocks_for(seq.context_len, block_size)
            tables[row, :num_blocks] = torch.as_tensor(seq.block_table[:num_blocks])
        lengths = torch.tensor([seq.context_len for seq in decodes])
        mask = torch.arange(max_context)[None, :] < lengths[:, None]
        rows = torch.tensor([seq.start for seq in decodes])
        batch = DecodeBatch(
            rows.to(device),
            tables.to(device),
            mask[:, None, None, :].to(device),
            ~mask[:, None, :, None].to(device),
        )
        return cls(seqs, positions, slots, batch, chunks)


def paged_attention(
    q: torch.Tensor, layout: StepLayout, kv_cache: KVCache, layer: int
) -> torch.Tensor:
    """Attention of the packed queries ``q`` (``[num_tokens, heads, dim]``) over the
    cache; ``[num_tokens, heads * dim]``. Grouped-query caches (fewer KV heads) are
    expanded to the query heads."""
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // kv_cache.num_kv_heads
    out = torch.empty_like(q)
    decodes = layout.decodes
    if decodes is not None:
        num_decodes, max_blocks = decodes.tables.shape
        max_context = decodes.mask.shape[-1]
        shape = (num_decodes, max_blocks * kv_cache.block_size, kv_cache.num_kv_heads, head_dim)
        keys = kv_cache.k[layer][decodes.tables].reshape(shape)[:, :max_context]
        values = kv_cache.v[layer][decodes.tables].reshape(shape)[:, :max_context]
        keys = keys.transpose(1, 2).to(q.dtype)  # [num_decodes, kv_heads, context, dim]
        values = values.transpose(1, 2).to(q.dtype)
        keys = keys.masked_fill(decodes.padding, 0)
        values = values.masked_fill(decodes.padding, 0)
        if group > 1:
            keys = keys.repeat_interleave(group, dim=1)
            values = values.repeat_interleave(group, dim=1)
        queries = q[decodes.rows][:, :, None, :]  # [num_decodes, heads, 1, dim]
        attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=decodes.mask)
        out[decodes.rows] = attended[:, :, 0, :]
    positions = layout.positions
    for seq in layout.chunks:
        seq_q = q[seq.start : seq.end].transpose(0, 1)  # [heads, num_new, dim]
        seq_k, seq_v = kv_cache.gather(layer, seq.block_table, seq.context_len)
        if group > 1:
            seq_k = seq_k.repeat_interleave(group, dim=1)
            seq_v = seq_v.repeat_interleave(group, dim=1)
        # Query at position p attends to keys at positions 0..p.
        key_positions = torch.arange(seq.context_len, device=q.device)
        mask = key_positions[None, :] <= positions[seq.start : seq.end, None]
        attended = F.scaled_dot_product_attention(
            seq_q,
            seq_k.transpose(0, 1).to(seq_q.dtype),
            seq_v.transpose(0, 1).to(seq_q.dtype),
            attn_mask=mask,
        )
        out[seq.start : seq.end] = attended.transpose(0, 1)
    return out.reshape(num_tokens, num_heads * head_dim)
