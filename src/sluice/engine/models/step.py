"""One engine step's packed inputs, shared by every model: which tokens belong to which
sequence, where their K/V go in the paged cache, and the checks that they fit together."""

from __future__ import annotations

import array
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sluice.engine.kv_cache import KVCache, num_blocks_for
from sluice.engine.models.native_attention import (
    NativeAttention,
    NativeGroup,
    load_native_attention,
)

__all__ = [
    "MAX_NATIVE_QUERY_TOKENS",
    "AttentionGroup",
    "StepError",
    "StepLayout",
    "StepSequence",
    "begin_step",
    "decode_layout",
    "last_token_indices",
    "long_tensor",
    "packed_slots",
    "paged_attention",
    "write_and_attend",
]


# A sequence with at most this many new tokens (a decode, a speculative verify) is attended
# by the C kernel when it can be (native_attention.py): it reads each key once per query, so
# it pays for few queries; a longer prefill chunk goes to scaled_dot_product_attention,
# whose blocked matrix products reuse each key across the chunk's queries.
MAX_NATIVE_QUERY_TOKENS = 16


def long_tensor(values: Iterable[int]) -> torch.Tensor:
    """A 1-D ``int64`` CPU tensor of ``values``, through an :class:`array.array` that it
    keeps: a third of ``torch.tensor``'s time on a list (64 ints: 2 µs against 7; a step's
    block tables, 1,024: 30 µs against 75), which a step pays a few times."""
    buffer = array.array("q", values)
    if not buffer:  # frombuffer refuses an empty buffer
        return torch.empty(0, dtype=torch.long)
    return torch.frombuffer(buffer, dtype=torch.long)


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
    num_logits: int = 1  # logits of its last ``num_logits`` new tokens (a verify: k + 1)

    def __post_init__(self) -> None:
        if self.start < 0:
            raise StepError(f"start must be >= 0, got {self.start}")
        if self.num_new_tokens <= 0:
            raise StepError(f"num_new_tokens must be positive, got {self.num_new_tokens}")
        if self.context_len < self.num_new_tokens:
            raise StepError(
                f"context_len {self.context_len} < num_new_tokens {self.num_new_tokens}"
            )
        if not 1 <= self.num_logits <= self.num_new_tokens:
            raise StepError(
                f"num_logits must be in [1, num_new_tokens={self.num_new_tokens}], "
                f"got {self.num_logits}"
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
    """The cache slot of every packed token, through its sequence's block table.

    Worked out in Python from each sequence's ``context_len`` (its new tokens sit at the
    last ``num_new_tokens`` positions), then made one tensor: a step of 64 decodes costs
    one tensor, not a few per sequence.
    """
    block_size = kv_cache.block_size
    slots: list[int] = []
    for seq in seqs:
        table = seq.block_table
        for pos in range(seq.context_len - seq.num_new_tokens, seq.context_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    return torch.tensor(slots, dtype=torch.long, device=positions.device)


def last_token_indices(seqs: Sequence[StepSequence], device: torch.device) -> torch.Tensor:
    """The packed index of each sequence's last ``num_logits`` new tokens (where its logits
    come from), in order: one per sequence, except for speculative verifies."""
    if all(seq.num_logits == 1 for seq in seqs):
        return torch.tensor([seq.end - 1 for seq in seqs], device=device)
    indices = [i for seq in seqs for i in range(seq.end - seq.num_logits, seq.end)]
    return torch.tensor(indices, device=device)


@dataclass(frozen=True)
class AttentionGroup:
    """Sequences whose queries attend in ONE ``scaled_dot_product_attention`` call.

    Each of the ``n`` sequences brings ``q_len`` query rows (its new tokens, padded) and
    ``max_context`` key positions, read straight out of the cache's flat slots by
    ``key_slots`` in one ``index_select``: exactly the slots its block table names, and
    the cache's zero slot past its context (so no stale or NaN K/V is ever attended, and
    nothing has to be masked-filled afterwards).
    """

    n: int
    q_len: int
    max_context: int
    key_slots: torch.Tensor  # [n * max_context] flat cache slot of each key position
    # [n, 1, q_len, max_context] which keys each query sees; None: all of them.
    mask: torch.Tensor | None
    # [n * q_len] packed row of each query; None: the group's queries are the packed
    # tokens themselves, in order (a step of decodes only).
    rows: torch.Tensor | None
    # Which of the ``n * q_len`` query rows are real (not padding); None: all.
    valid: torch.Tensor | None
    out_rows: torch.Tensor | None  # the packed row each real query's output goes to

    @classmethod
    def of(
        cls,
        seqs: Sequence[StepSequence],
        num_packed_tokens: int,
        kv_cache: KVCache,
        device: torch.device,
    ) -> AttentionGroup:
        block_size = kv_cache.block_size
        n = len(seqs)
        q_len = max(seq.num_new_tokens for seq in seqs)
        max_context = max(seq.context_len for seq in seqs)
        max_blocks = num_blocks_for(max_context, block_size)
        tables = [
            list(seq.block_table[:max_blocks])
            + [0] * (max_blocks - min(max_blocks, len(seq.block_table)))
            for seq in seqs
        ]
        slots = (
            torch.tensor(tables, dtype=torch.long)[:, :, None] * block_size
            + torch.arange(block_size)
        ).view(n, max_blocks * block_size)[:, :max_context]
        contexts = [seq.context_len for seq in seqs]
        mask: torch.Tensor | None = None
        if min(contexts) < max_context:
            in_context = torch.arange(max_context) < torch.tensor(contexts)[:, None]
            slots = torch.where(in_context, slots, kv_cache.zero_slot)
        if q_len == 1:
            if mask is None and min(contexts) < max_context:
                mask = in_context[:, None, None, :]
            starts = [seq.start for seq in seqs]
            in_order = starts == list(range(num_packed_tokens))
            rows = None if in_order else torch.tensor(starts, device=device)
            return cls(
                n,
                1,
                max_context,
                slots.reshape(-1).to(device),
                None if mask is None else mask.to(device),
                rows,
                None,
                rows,
            )
        # Chunks: query i of a sequence sits at position context_len - num_new + i and sees
        # keys 0..that position; a padding query sits at position 0 (sees key 0 only).
        query_positions = [
            [seq.context_len - seq.num_new_tokens + i for i in range(seq.num_new_tokens)]
            + [0] * (q_len - seq.num_new_tokens)
            for seq in seqs
        ]
        query_rows = [
            [seq.start + i for i in range(seq.num_new_tokens)]
            + [seq.start] * (q_len - seq.num_new_tokens)
            for seq in seqs
        ]
        causal = (
            torch.arange(max_context)[None, None, :] <= torch.tensor(query_positions)[:, :, None]
        )
        valid_list = [i < seq.num_new_tokens for seq in seqs for i in range(q_len)]
        rows_tensor = torch.tensor(query_rows).reshape(-1)
        valid: torch.Tensor | None = None
        out_rows = rows_tensor
        if not all(valid_list):
            valid = torch.tensor(valid_list)
            out_rows = rows_tensor[valid]
            valid = valid.to(device)
        return cls(
            n,
            q_len,
            max_context,
            slots.reshape(-1).to(device),
            causal[:, None].to(device),
            rows_tensor.to(device),
            valid,
            out_rows.to(device),
        )


@dataclass(frozen=True)
class StepLayout:
    """How one step's packed tokens attend, worked out once per step for every layer.

    Decoding sequences (one new token each) attend in ONE call, and so do the sequences
    with several new tokens (prefill chunks), each with its causal mask. Mixing both in one
    padded group would pad every decode to the longest chunk. On a float32 CPU cache the C
    kernel takes the decodes and short verifies instead (``native``), reading the cache in
    place; ``groups`` then holds the longer chunks only.
    """

    seqs: Sequence[StepSequence]
    positions: torch.Tensor
    slots: torch.Tensor  # the cache slot of every packed token
    groups: tuple[AttentionGroup, ...]  # the decodes' group, then the chunks' group
    native: NativeGroup | None = None

    @classmethod
    def of(
        cls, seqs: Sequence[StepSequence], positions: torch.Tensor, kv_cache: KVCache
    ) -> StepLayout:
        device = positions.device
        slots = packed_slots(positions, seqs, kv_cache)
        num_tokens = int(positions.shape[0])
        kernel = load_native_attention(kv_cache)
        native: NativeGroup | None = None
        if kernel is not None:
            short = [seq for seq in seqs if seq.num_new_tokens <= MAX_NATIVE_QUERY_TOKENS]
            if short:
                native = native_group(kernel, short, kv_cache)
            members = [[seq for seq in seqs if seq.num_new_tokens > MAX_NATIVE_QUERY_TOKENS]]
        else:
            members = [
                [seq for seq in seqs if seq.num_new_tokens == 1],
                [seq for seq in seqs if seq.num_new_tokens > 1],
            ]
        groups = tuple(
            AttentionGroup.of(group, num_tokens, kv_cache, device) for group in members if group
        )
        return cls(seqs, positions, slots, groups, native)


def padded_tables(block_tables: Sequence[Sequence[int]], max_blocks: int) -> torch.Tensor:
    """``[len(block_tables), max_blocks]`` int64: each table cut to ``max_blocks``, or
    padded with block 0 (never read: the kernel reads a row's keys up to its length)."""
    return long_tensor(
        itertools.chain.from_iterable(
            itertools.islice(itertools.chain(table, itertools.repeat(0)), max_blocks)
            for table in block_tables
        )
    ).view(len(block_tables), max_blocks)


def decode_layout(
    block_tables: Sequence[Sequence[int]],
    context_lens: Sequence[int],
    kv_cache: KVCache,
    *,
    max_positions: int,
) -> StepLayout | None:
    """The layout of a step of decodes, sequence ``i``'s token at position
    ``context_lens[i] - 1``, packed in order, attended by the C kernel; None where the
    kernel does not take the cache (the caller lays the step out by :func:`begin_step`).

    What :func:`begin_step` would give these sequences, in a few Python passes and five
    tensors, where that path makes and checks a :class:`StepSequence` per sequence: at 64
    decoding sequences that was a twentieth of the step. Raises :class:`StepError` as
    that path would.
    """
    kernel = load_native_attention(kv_cache)
    if kernel is None:
        return None
    if not block_tables or len(block_tables) != len(context_lens):
        raise StepError(f"need a context length per block table, got {len(context_lens)}")
    block_size = kv_cache.block_size
    max_context = max(context_lens)
    if max_context > max_positions or min(context_lens) < 1:
        raise StepError(
            f"context lengths {min(context_lens)}..{max_context} outside 1..{max_positions}"
        )
    slots: list[int] = []
    for index, (table, context_len) in enumerate(zip(block_tables, context_lens, strict=True)):
        position = context_len - 1
        if len(table) <= position // block_size:
            raise StepError(
                f"sequence {index} needs {num_blocks_for(context_len, block_size)} blocks for "
                f"context_len {context_len}, block_table has {len(table)}"
            )
        slots.append(table[position // block_size] * block_size + position % block_size)
    rows = torch.arange(len(slots), dtype=torch.long)
    contexts = long_tensor(context_lens)
    slot_tensor = long_tensor(slots)
    tables = padded_tables(block_tables, num_blocks_for(max_context, block_size))
    native = NativeGroup(kernel, rows, rows, contexts, tables, slots=slot_tensor)
    return StepLayout((), contexts - 1, slot_tensor, (), native)


def native_group(
    kernel: NativeAttention, seqs: Sequence[StepSequence], kv_cache: KVCache
) -> NativeGroup:
    """The kernel's rows for ``seqs``: each new token attends to the keys up to its own."""
    max_blocks = num_blocks_for(max(seq.context_len for seq in seqs), kv_cache.block_size)
    rows: list[int] = []
    row_seqs: list[int] = []
    row_lens: list[int] = []
    for index, seq in enumerate(seqs):
        first = seq.context_len - seq.num_new_tokens + 1
        rows.extend(range(seq.start, seq.end))
        row_seqs.extend([index] * seq.num_new_tokens)
        row_lens.extend(range(first, seq.context_len + 1))
    return NativeGroup(
        kernel,
        long_tensor(rows),
        long_tensor(row_seqs),
        long_tensor(row_lens),
        padded_tables([seq.block_table for seq in seqs], max_blocks),
    )


def attend_group(
    q: torch.Tensor, group: AttentionGroup, kv_cache: KVCache, layer: int
) -> torch.Tensor:
    """The group's attention output, ``[n * q_len, heads, dim]`` (padding rows included)."""
    _, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.num_kv_heads
    queries = q if group.rows is None else q.index_select(0, group.rows)
    queries = queries.view(group.n, group.q_len, num_heads, head_dim).transpose(1, 2)
    kv_shape = (group.n, group.max_context, num_kv_heads, head_dim)
    keys = kv_cache.flat_k[layer].index_select(0, group.key_slots).view(kv_shape)
    values = kv_cache.flat_v[layer].index_select(0, group.key_slots).view(kv_shape)
    attended = F.scaled_dot_product_attention(
        queries,
        keys.transpose(1, 2).to(q.dtype),
        values.transpose(1, 2).to(q.dtype),
        attn_mask=group.mask,
        enable_gqa=num_heads != num_kv_heads,
    )
    return attended.transpose(1, 2).reshape(group.n * group.q_len, num_heads, head_dim)


def write_and_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: StepLayout,
    kv_cache: KVCache,
    layer: int,
) -> torch.Tensor:
    """The step's new ``k`` and ``v`` (``[num_tokens, kv_heads, dim]``) written to layer
    ``layer`` of the cache at ``layout.slots``, then :func:`paged_attention` of ``q``: in
    one kernel call where the C kernel takes every token and knows its slot (a step of
    decodes, :func:`decode_layout`), else :meth:`KVCache.write` and then the attention."""
    native = layout.native
    if (
        native is None
        or native.slots is None
        or layout.groups
        or q.dtype is not torch.float32
        or k.dtype is not torch.float32
        or v.dtype is not torch.float32
    ):
        kv_cache.write(layer, layout.slots, k, v)
        return paged_attention(q, layout, kv_cache, layer)
    num_tokens, num_heads, head_dim = q.shape
    expected = (num_tokens, kv_cache.num_kv_heads, kv_cache.head_dim)
    if k.shape != expected or v.shape != expected or native.rows.shape[0] != num_tokens:
        raise StepError(
            f"k and v must have shape {expected} for {native.rows.shape[0]} rows, "
            f"got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=torch.float32)
    native.attend(q, out, kv_cache, layer, (k, v))
    return out.view(num_tokens, num_heads * head_dim)


def paged_attention(
    q: torch.Tensor, layout: StepLayout, kv_cache: KVCache, layer: int
) -> torch.Tensor:
    """Attention of the packed queries ``q`` (``[num_tokens, heads, dim]``) over the
    cache; ``[num_tokens, heads * dim]``. Grouped-query caches (fewer KV heads) are
    attended as such (``enable_gqa``), never expanded."""
    num_tokens, num_heads, head_dim = q.shape
    if layout.native is not None:
        return native_attention(q, layout, kv_cache, layer)
    if len(layout.groups) == 1 and layout.groups[0].rows is None:
        # Decodes only: the group's output rows are the packed rows.
        return attend_group(q, layout.groups[0], kv_cache, layer).reshape(
            num_tokens, num_heads * head_dim
        )
    out = torch.empty_like(q)
    attend_groups(q, layout.groups, out, kv_cache, layer)
    return out.reshape(num_tokens, num_heads * head_dim)


def attend_groups(
    q: torch.Tensor,
    groups: Sequence[AttentionGroup],
    out: torch.Tensor,
    kv_cache: KVCache,
    layer: int,
) -> None:
    """Write each group's attention to its rows of ``out`` (``[num_tokens, heads, dim]``)."""
    for attention_group in groups:
        attended = attend_group(q, attention_group, kv_cache, layer)
        if attention_group.valid is not None:
            attended = attended[attention_group.valid]
        assert attention_group.out_rows is not None
        out.index_copy_(0, attention_group.out_rows, attended)


def native_attention(
    q: torch.Tensor, layout: StepLayout, kv_cache: KVCache, layer: int
) -> torch.Tensor:
    """:func:`paged_attention` with the kernel taking ``layout.native``'s rows (in float32)
    and scaled_dot_product_attention the chunks of ``layout.groups``."""
    assert layout.native is not None
    num_tokens, num_heads, head_dim = q.shape
    query = q if q.dtype is torch.float32 else q.float()
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=torch.float32)
    layout.native.attend(query, out, kv_cache, layer)
    attend_groups(query, layout.groups, out, kv_cache, layer)
    return out.view(num_tokens, num_heads * head_dim).to(q.dtype)
