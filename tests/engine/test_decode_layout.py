"""A step of decodes laid out by ``decode_layout`` (the engine's steady state) gives the
logits of the checked step path (``begin_step``), for GPT-2 and Llama, sequences of
different lengths; it refuses what that path refuses, and leaves caches the kernel does not
take to that path."""

from __future__ import annotations

import gc

import pytest
import torch

from sluice.engine.models import StepError, StepSequence
from sluice.engine.models.step import decode_layout, long_tensor
from tests.engine.test_decode_rounds import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    PROMPTS,
    TABLES,
    make_model,
    prefill,
)

ATOL = 1e-5


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_step_of_decodes_gives_the_checked_paths_logits(kind: str) -> None:
    model = make_model(kind)
    caches = [model.make_kv_cache(NUM_BLOCKS, BLOCK_SIZE) for _ in range(2)]
    for cache in caches:
        prefill(model, cache)
    tokens = torch.tensor([17, 29, 31])
    contexts = [len(prompt) + 1 for prompt in PROMPTS]  # each sequence's next token
    layout = decode_layout(TABLES, contexts, caches[0], max_positions=64)
    assert layout is not None
    seqs = [
        StepSequence(i, 1, context, tuple(table))
        for i, (context, table) in enumerate(zip(contexts, TABLES, strict=True))
    ]
    with torch.inference_mode():
        fast = model.decode(tokens, layout.positions, layout, caches[0])
        checked = model(tokens, torch.tensor([c - 1 for c in contexts]), seqs, caches[1])
    torch.testing.assert_close(fast, checked, atol=ATOL, rtol=0)
    for layer in range(len(caches[0].flat_k)):  # the new K/V went to the same slots
        assert torch.equal(caches[0].flat_k[layer], caches[1].flat_k[layer])
        assert torch.equal(caches[0].flat_v[layer], caches[1].flat_v[layer])


def test_a_table_short_of_the_context_or_a_position_past_the_model_is_refused() -> None:
    cache = make_model("gpt2").make_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    with pytest.raises(StepError, match="block_table has 4"):
        decode_layout([TABLES[2]], [4 * BLOCK_SIZE + 1], cache, max_positions=64)
    with pytest.raises(StepError, match=r"outside 1\.\.8"):
        decode_layout([TABLES[1]], [9], cache, max_positions=8)
    with pytest.raises(StepError, match="a context length per block table"):
        decode_layout(TABLES, [3, 4], cache, max_positions=64)


def test_a_cache_the_kernel_does_not_take_is_left_to_the_checked_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    float64 = make_model("gpt2").make_kv_cache(NUM_BLOCKS, BLOCK_SIZE, dtype=torch.float64)
    assert decode_layout([[0]], [1], float64, max_positions=8) is None
    monkeypatch.setenv("SLUICE_NATIVE_KERNELS", "0")
    float32 = make_model("gpt2").make_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    assert decode_layout([[0]], [1], float32, max_positions=8) is None


def test_long_tensor_holds_its_values_after_the_list_is_gone() -> None:
    values = [7, -3, 2**40]
    tensor = long_tensor(iter(values))
    del values
    gc.collect()
    assert tensor.dtype == torch.long
    assert tensor.tolist() == [7, -3, 2**40]
    assert long_tensor([]).shape == (0,)
