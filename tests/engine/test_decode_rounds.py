"""A draft model's decode rounds laid out once (``DecodeRounds`` + a model's ``decode``) give
the logits of the checked step path, for GPT-2 and Llama, sequences of different lengths and
rounds included; the LM head's transposed copy follows its weight."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sluice.engine.kv_cache import KVCache
from sluice.engine.models import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    StepError,
    StepSequence,
)
from sluice.engine.models.decode import DecodeRounds
from sluice.engine.models.head import LMHead
from tests.engine.tiny_models import varied_gpt2

pytestmark = pytest.mark.usefixtures("kernel_path")

BLOCK_SIZE = 4
NUM_BLOCKS = 32
ATOL = 1e-5
GPT2 = GPT2Config(vocab_size=101, n_positions=64, n_embd=32, n_layer=2, n_head=4)
LLAMA = LlamaConfig(
    vocab_size=101,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
# Three sequences: their block tables interleave, their prompts and rounds differ.
TABLES = [[3, 7, 1, 12, 20], [5, 0, 9, 14, 21, 22], [2, 11, 6, 15]]
PROMPTS = [[4, 8, 15, 16, 23], [42, 1, 2, 3, 4, 5, 6, 7, 8], [9]]
ROUNDS = [3, 5, 2]


def make_model(kind: str) -> GPT2LMHeadModel | LlamaForCausalLM:
    if kind == "gpt2":
        return varied_gpt2(GPT2)
    torch.manual_seed(0)
    return LlamaForCausalLM(LLAMA).eval()


def prefill(model: GPT2LMHeadModel | LlamaForCausalLM, cache: KVCache) -> None:
    tokens = [t for prompt in PROMPTS for t in prompt]
    positions = [p for prompt in PROMPTS for p in range(len(prompt))]
    seqs, start = [], 0
    for prompt, table in zip(PROMPTS, TABLES, strict=True):
        seqs.append(StepSequence(start, len(prompt), len(prompt), tuple(table)))
        start += len(prompt)
    with torch.inference_mode():
        model(torch.tensor(tokens), torch.tensor(positions), seqs, cache)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_decode_rounds_match_the_checked_step_round_by_round(kind: str) -> None:
    model = make_model(kind)
    checked, laid_out = (model.make_kv_cache(NUM_BLOCKS, BLOCK_SIZE) for _ in range(2))
    prefill(model, checked)
    prefill(model, laid_out)
    rounds = DecodeRounds(TABLES, [len(p) for p in PROMPTS], ROUNDS, laid_out, max_positions=64)
    for round_ in range(max(ROUNDS)):
        rows = [i for i, count in enumerate(ROUNDS) if count > round_]
        tokens = [(7 * round_ + 3 * row) % 101 for row in rows]
        seqs = [
            StepSequence(n, 1, len(PROMPTS[row]) + round_ + 1, tuple(TABLES[row]))
            for n, row in enumerate(rows)
        ]
        positions = [len(PROMPTS[row]) + round_ for row in rows]
        layout = rounds.layout(round_, None if len(rows) == len(PROMPTS) else rows)
        assert layout.positions.tolist() == positions
        with torch.inference_mode():
            expected = model(torch.tensor(tokens), torch.tensor(positions), seqs, checked)
            got = model.decode(torch.tensor(tokens), layout.positions, layout, laid_out)
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_decode_rounds_refuse_rounds_their_blocks_do_not_cover() -> None:
    cache = GPT2LMHeadModel(GPT2).make_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    with pytest.raises(StepError, match="blocks"):
        DecodeRounds([[1, 2]], [7], [2], cache, max_positions=64)  # position 8: block 2
    with pytest.raises(StepError, match="positions"):
        DecodeRounds([list(range(17))], [62], [3], cache, max_positions=64)
    with pytest.raises(StepError, match="round"):
        DecodeRounds([[1, 2]], [1], [0], cache, max_positions=64)
    rounds = DecodeRounds([[1, 2], [3, 4]], [1, 1], [3, 1], cache, max_positions=64)
    with pytest.raises(StepError, match="fewer rounds"):
        rounds.layout(1)  # the second sequence has one round only
    assert rounds.layout(1, [0]).slots.tolist() == [1 * BLOCK_SIZE + 2]


def test_lm_head_follows_its_weight_changed_in_place_or_replaced() -> None:
    linear = nn.Linear(8, 16, bias=False)
    head = LMHead(linear)
    hidden = torch.randn(3, 8)
    with torch.inference_mode():
        torch.testing.assert_close(head(hidden), hidden @ linear.weight.T)
    with torch.no_grad():
        linear.weight.mul_(2)  # in place, as load_state_dict does
        torch.testing.assert_close(head(hidden), hidden @ linear.weight.T)
    linear.weight = nn.Parameter(torch.randn(16, 8))  # replaced, as the loader's tying does
    with torch.no_grad():
        torch.testing.assert_close(head(hidden), hidden @ linear.weight.T)
    # With gradients wanted the head is the plain linear, and gradients reach the weight.
    head(hidden).sum().backward()
    assert linear.weight.grad is not None
