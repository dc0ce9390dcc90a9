"""The C paged attention kernel gives the torch path's attention, reads only the cache.

Each test lays out one step twice, with the kernel (``SLUICE_NATIVE_KERNELS`` unset) and
without it (``=0``), and compares what :func:`paged_attention` returns. The torch path is
itself checked against cache-free reference models in test_gpt2_paged.py and
test_llama_paged.py, which run both paths too.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import torch

from sluice.engine.kv_cache import KVCache
from sluice.engine.models.native_attention import load_native_attention
from sluice.engine.models.native_build import NativeKernelError, build_kernel
from sluice.engine.models.step import (
    MAX_NATIVE_QUERY_TOKENS,
    StepLayout,
    StepSequence,
    decode_layout,
    paged_attention,
    write_and_attend,
)

BLOCK_SIZE = 4
NUM_BLOCKS = 64
ATOL = 1e-5


def make_cache(num_kv_heads: int, head_dim: int, *, seed: int = 0) -> KVCache:
    torch.manual_seed(seed)
    cache = KVCache(
        num_layers=2,
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=torch.float32,
        device="cpu",
    )
    for flat in (*cache.flat_k, *cache.flat_v):
        flat[:-1].normal_()
    return cache


def make_step(new_token_counts: list[int], context_lens: list[int]) -> list[StepSequence]:
    """Sequences with shuffled, disjoint block tables (a paged cache's usual state)."""
    blocks = list(range(NUM_BLOCKS))
    random.Random(1).shuffle(blocks)
    seqs, start = [], 0
    for num_new, context_len in zip(new_token_counts, context_lens, strict=True):
        num_blocks = -(-context_len // BLOCK_SIZE)
        table, blocks = blocks[:num_blocks], blocks[num_blocks:]
        seqs.append(StepSequence(start, num_new, context_len, table))
        start += num_new
    return seqs


def attend_both_ways(
    monkeypatch: pytest.MonkeyPatch,
    seqs: list[StepSequence],
    cache: KVCache,
    num_heads: int,
    *,
    q: torch.Tensor | None = None,
) -> tuple[StepLayout, torch.Tensor, torch.Tensor]:
    num_tokens = seqs[-1].end
    if q is None:
        q = torch.randn(num_tokens, num_heads, cache.head_dim)
    positions = torch.tensor(
        [p for seq in seqs for p in range(seq.context_len - seq.num_new_tokens, seq.context_len)]
    )
    native_layout = StepLayout.of(seqs, positions, cache)
    monkeypatch.setenv("SLUICE_NATIVE_KERNELS", "0")
    torch_layout = StepLayout.of(seqs, positions, cache)
    monkeypatch.delenv("SLUICE_NATIVE_KERNELS")
    assert torch_layout.native is None
    native = paged_attention(q, native_layout, cache, 1)
    reference = paged_attention(q, torch_layout, cache, 1)
    return native_layout, native, reference


def test_kernel_builds_and_loads_on_this_machine() -> None:
    assert load_native_attention() is not None


def test_decodes_of_different_lengths_match_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = make_cache(num_kv_heads=4, head_dim=32)
    contexts = [1, 3, 4, 5, 17, 40, 33]
    seqs = make_step([1] * len(contexts), contexts)
    layout, native, reference = attend_both_ways(monkeypatch, seqs, cache, 4)
    assert layout.native is not None
    assert layout.groups == ()
    torch.testing.assert_close(native, reference, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(9, 3, 64), (4, 1, 128), (6, 2, 48), (2, 2, 8)],
    ids=["gqa-64", "mqa-128", "generic-dim-48", "small-8"],
)
def test_grouped_query_heads_and_head_dims_match_the_torch_path(
    monkeypatch: pytest.MonkeyPatch, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    cache = make_cache(num_kv_heads=num_kv_heads, head_dim=head_dim)
    seqs = make_step([1, 1, 1], [9, 2, 30])
    _, native, reference = attend_both_ways(monkeypatch, seqs, cache, num_heads)
    torch.testing.assert_close(native, reference, atol=ATOL, rtol=0)


def test_verify_rows_are_causal_within_their_sequence(monkeypatch: pytest.MonkeyPatch) -> None:
    """A speculative verify's k + 1 rows each see the keys up to their own position."""
    cache = make_cache(num_kv_heads=2, head_dim=32)
    seqs = make_step([5, 1, 3], [12, 7, 3])
    layout, native, reference = attend_both_ways(monkeypatch, seqs, cache, 2)
    assert layout.native is not None
    assert layout.native.row_lens.tolist() == [8, 9, 10, 11, 12, 7, 1, 2, 3]
    torch.testing.assert_close(native, reference, atol=ATOL, rtol=0)


def test_long_chunks_go_to_sdpa_beside_the_kernels_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = make_cache(num_kv_heads=2, head_dim=32)
    long_chunk = MAX_NATIVE_QUERY_TOKENS + 3
    seqs = make_step([1, long_chunk, 2, long_chunk + 5], [20, long_chunk + 4, 6, long_chunk + 5])
    layout, native, reference = attend_both_ways(monkeypatch, seqs, cache, 2)
    assert layout.native is not None
    assert layout.native.rows.numel() == 3
    assert len(layout.groups) == 1
    assert layout.groups[0].n == 2
    torch.testing.assert_close(native, reference, atol=ATOL, rtol=0)


def test_query_with_token_stride_wider_than_its_heads(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT-2's q is a view into its fused qkv projection: rows 3 x heads x dim apart."""
    cache = make_cache(num_kv_heads=4, head_dim=32)
    seqs = make_step([1, 1], [6, 11])
    qkv = torch.randn(2, 3, 4, 32)
    q = qkv.unbind(dim=1)[0]
    assert not q.is_contiguous()
    _, native, reference = attend_both_ways(monkeypatch, seqs, cache, 4, q=q)
    torch.testing.assert_close(native, reference, atol=ATOL, rtol=0)


def test_keys_past_a_rows_context_are_never_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """NaN in the unused slots of a sequence's last block does not reach its output."""
    cache = make_cache(num_kv_heads=2, head_dim=32)
    seqs = make_step([1], [6])  # two blocks of 4: slots 6 and 7 of the table are unused
    last_block = seqs[0].block_table[1]
    for flat in (cache.flat_k[1], cache.flat_v[1]):
        flat[last_block * BLOCK_SIZE + 2 : last_block * BLOCK_SIZE + 4] = float("nan")
    _, native, reference = attend_both_ways(monkeypatch, seqs, cache, 2)
    assert torch.isfinite(native).all()
    torch.testing.assert_close(native, reference, atol=ATOL, rtol=0)


def test_a_block_outside_the_cache_is_refused_not_read() -> None:
    cache = make_cache(num_kv_heads=2, head_dim=32)
    layout = StepLayout.of([StepSequence(0, 1, 6, [3, NUM_BLOCKS + 10])], torch.tensor([5]), cache)
    with pytest.raises(NativeKernelError, match="outside"):
        paged_attention(torch.randn(1, 2, 32), layout, cache, 0)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2)])
def test_the_kernel_writes_a_steps_new_kv_as_the_cache_write_does(
    num_heads: int, num_kv_heads: int
) -> None:
    """A step of decodes whose K and V the kernel writes itself (``write_and_attend``) leaves
    the cache and gives the attention of ``KVCache.write`` then ``paged_attention``; the
    new K and V may be strided views (of a fused QKV projection)."""
    caches = [make_cache(num_kv_heads, 32) for _ in range(2)]
    seqs = make_step([1] * 5, [1, 4, 5, 17, 40])
    tables = [list(seq.block_table) for seq in seqs]
    contexts = [seq.context_len for seq in seqs]
    qkv = torch.randn(5, num_heads + 2 * num_kv_heads, 32)
    q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    assert not k.is_contiguous()
    fused = decode_layout(tables, contexts, caches[0], max_positions=64)
    assert fused is not None
    written = write_and_attend(q, k, v, fused, caches[0], 1)
    positions = torch.tensor([context - 1 for context in contexts])
    checked = StepLayout.of(seqs, positions, caches[1])
    caches[1].write(1, checked.slots, k, v)
    reference = paged_attention(q, checked, caches[1], 1)
    torch.testing.assert_close(written, reference, atol=ATOL, rtol=0)
    assert torch.equal(caches[0].flat_k[1], caches[1].flat_k[1])
    assert torch.equal(caches[0].flat_v[1], caches[1].flat_v[1])


def test_a_write_slot_outside_the_cache_is_refused_and_nothing_written() -> None:
    cache = make_cache(num_kv_heads=2, head_dim=32)
    layout = decode_layout([[3, 5]], [6], cache, max_positions=64)
    assert layout is not None
    assert layout.native is not None
    layout.native.slots[0] = NUM_BLOCKS * BLOCK_SIZE  # the zero slot: not a block's
    before = cache.flat_k[0].clone()
    k = v = torch.randn(1, 2, 32)
    with pytest.raises(NativeKernelError, match="outside"):
        write_and_attend(torch.randn(1, 2, 32), k, v, layout, cache, 0)
    assert torch.equal(cache.flat_k[0], before)


def test_a_float16_cache_keeps_the_torch_path() -> None:
    cache = KVCache(
        num_layers=1,
        num_blocks=4,
        block_size=4,
        num_kv_heads=2,
        head_dim=8,
        dtype=torch.float16,
        device="cpu",
    )
    assert load_native_attention(cache) is None
    layout = StepLayout.of([StepSequence(0, 1, 3, [0])], torch.tensor([2]), cache)
    assert layout.native is None


def test_the_kernel_is_built_once_per_source_compiler_and_cpu(tmp_path: Path) -> None:
    cache_dir = tmp_path
    first = build_kernel(cache_dir, "cc", "paged_attention")
    built_at = first.stat().st_mtime_ns
    again = build_kernel(cache_dir, "cc", "paged_attention")
    assert again == first
    assert again.stat().st_mtime_ns == built_at
    assert [path.name for path in cache_dir.iterdir()] == [first.name]
    assert first.name.startswith("paged_attention-")


def test_no_compiler_is_an_os_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="no-such-cc"):
        build_kernel(tmp_path, "no-such-cc", "paged_attention")


def test_an_unknown_kernel_is_an_os_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="no-such-kernel"):
        build_kernel(tmp_path, "cc", "no-such-kernel")


def test_turned_off_by_the_environment(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("SLUICE_NATIVE_KERNELS", "0")
    with caplog.at_level(logging.WARNING):
        assert load_native_attention() is None
    assert caplog.records == []
