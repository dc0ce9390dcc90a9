"""GPT-2 over the paged KV cache matches a plain causal forward pass with the same weights.

The reference below recomputes full causal attention over the whole sequence with no cache,
straight from the state dict, so it shares no code with the paged model.
"""

from __future__ import annotations

import pytest
import torch

from sluice.engine.kv_cache import KVCache, KVCacheError, slot_mapping
from sluice.engine.models import GPT2Config, GPT2LMHeadModel, GPT2StepError, StepSequence

pytestmark = pytest.mark.usefixtures("kernel_path")

CONFIG = GPT2Config(vocab_size=101, n_positions=128, n_embd=64, n_layer=2, n_head=4)
BLOCK_SIZE = 8
NUM_BLOCKS = 16
ATOL = 1e-5


@pytest.fixture
def model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(CONFIG).eval()
    # Non-trivial LayerNorm and bias values so a wrong parameter would show.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias") or "ln_" in name:
                param.add_(0.05 * torch.randn_like(param))
    return model


def reference_logits(model: GPT2LMHeadModel, token_ids: list[int]) -> torch.Tensor:
    """Logits ``[len(token_ids), vocab]`` by full causal attention, no cache."""
    sd: dict[str, torch.Tensor] = model.state_dict()
    num_tokens = len(token_ids)
    num_heads, head_dim, eps = CONFIG.n_head, CONFIG.head_dim, CONFIG.layer_norm_epsilon

    def layer_norm(x: torch.Tensor, prefix: str) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        var = x.var(-1, keepdim=True, unbiased=False)
        return (x - mean) / torch.sqrt(var + eps) * sd[f"{prefix}.weight"] + sd[f"{prefix}.bias"]

    def conv1d(x: torch.Tensor, prefix: str) -> torch.Tensor:
        return x @ sd[f"{prefix}.weight"] + sd[f"{prefix}.bias"]

    def gelu_new(x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (x + 0.044715 * x**3)))

    ids = torch.tensor(token_ids)
    hidden = sd["transformer.wte.weight"][ids] + sd["transformer.wpe.weight"][:num_tokens]
    causal = torch.tril(torch.ones(num_tokens, num_tokens, dtype=torch.bool))
    for i in range(CONFIG.n_layer):
        h = f"transformer.h.{i}"
        qkv = conv1d(layer_norm(hidden, f"{h}.ln_1"), f"{h}.attn.c_attn")
        q, k, v = (
            t.view(num_tokens, num_heads, head_dim).transpose(0, 1) for t in qkv.chunk(3, dim=-1)
        )
        scores = q @ k.transpose(-1, -2) / head_dim**0.5
        weights = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        attended = (weights @ v).transpose(0, 1).reshape(num_tokens, -1)
        hidden = hidden + conv1d(attended, f"{h}.attn.c_proj")
        mlp_in = layer_norm(hidden, f"{h}.ln_2")
        hidden = hidden + conv1d(gelu_new(conv1d(mlp_in, f"{h}.mlp.c_fc")), f"{h}.mlp.c_proj")
    return layer_norm(hidden, "transformer.ln_f") @ sd["lm_head.weight"].T


def step(
    model: GPT2LMHeadModel,
    cache: KVCache,
    chunks: list[tuple[list[int], int, list[int]]],
) -> torch.Tensor:
    """Run one packed step; each chunk is (new token ids, context_len after, block_table)."""
    input_ids: list[int] = []
    positions: list[int] = []
    seqs = []
    for new_ids, context_len, block_table in chunks:
        seqs.append(StepSequence(len(input_ids), len(new_ids), context_len, block_table))
        input_ids += new_ids
        positions += range(context_len - len(new_ids), context_len)
    with torch.inference_mode():
        logits: torch.Tensor = model(torch.tensor(input_ids), torch.tensor(positions), seqs, cache)
    return logits


def random_tokens(num_tokens: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    ids: list[int] = torch.randint(
        0, CONFIG.vocab_size, (num_tokens,), generator=generator
    ).tolist()
    return ids


def test_state_dict_uses_hugging_face_names_with_tied_lm_head(model: GPT2LMHeadModel) -> None:
    sd = model.state_dict()
    assert sd["transformer.h.1.attn.c_attn.weight"].shape == (64, 192)
    assert sd["transformer.h.0.mlp.c_fc.weight"].shape == (64, 256)
    assert {"transformer.wpe.weight", "transformer.ln_f.bias", "lm_head.weight"} <= set(sd)
    assert model.lm_head.weight is model.transformer.wte.weight
    fresh = GPT2LMHeadModel(CONFIG)
    fresh.load_state_dict(sd)
    assert torch.equal(fresh.lm_head.weight, sd["transformer.wte.weight"])


def test_from_hf_config_reads_fields_and_rejects_other_activations() -> None:
    raw = {"vocab_size": 101, "n_positions": 128, "n_embd": 64, "n_layer": 2, "n_head": 4}
    assert GPT2Config.from_hf_config({**raw, "layer_norm_epsilon": 1e-5}) == CONFIG
    with pytest.raises(ValueError, match="activation_function"):
        GPT2Config.from_hf_config({**raw, "activation_function": "relu"})
    with pytest.raises(ValueError, match="divisible"):
        GPT2Config(n_embd=64, n_head=5)


def test_full_prefill_matches_reference_last_token(model: GPT2LMHeadModel) -> None:
    tokens = random_tokens(21, seed=1)
    cache = model.make_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    logits = step(model, cache, [(tokens, 21, [3, 9, 4])])
    expected = reference_logits(model, tokens)[-1:]
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_decode_one_token_at_a_time_matches_reference_at_every_position(
    model: GPT2LMHeadModel,
) -> None:
    tokens = random_tokens(30, seed=2)
    block_table = [11, 0, 6, 2]
    expected = reference_logits(model, tokens)
    cache = model.make_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    num_prompt = 5
    logits = step(model, cache, [(tokens[:num_prompt], num_prompt, block_table)])
    torch.testing.assert_close(logits[0], expected[num_prompt - 1], atol=ATOL, rtol=0)
    for position in range(num_prompt, len(tokens)):
        logits = step(model, cache, [([tokens[position]], position + 1, block_table)])
        torch.testing.assert_close(logits[0], expected[position], atol=ATOL, rtol=0)


def test_chunked_prefill_matches_single_prefill(model: GPT2LMHeadModel) -> None:
    tokens = random_tokens(40, seed=3)
    block_table = [7, 1, 12, 4, 9]
    cache = model.make_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    step(model, cache, [(tokens[:16], 16, block_table)])
    step(model, cache, [(tokens[16:32], 32, block_table)])
    logits = step(model, cache, [(tokens[32:], 40, block_table)])
    whole = step(model, model.make_kv_cache(NUM_BLOCKS, BLOCK_SIZE), [(tokens, 40, block_table)])
    torch.testing.assert_close(logits, whole, atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[0], reference_logits(model, tokens)[-1], atol=ATOL, rtol=0)


def test_packed_sequences_with_interleaved_blocks_match_each_alone(
    model: GPT2LMHeadModel,
) -> None:
    tokens_a, tokens_b = random_tokens(11, seed=4), random_tokens(19, seed=5)
    table_a, table_b = [5, 2], [0, 7, 3]
    cache = model.make_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    # Prefill both together (A has 9 tokens, B 17), then decode one token each, packed.
    step(model, cache, [(tokens_a[:9], 9, table_a), (tokens_b[:17], 17, table_b)])
    step(model, cache, [(tokens_b[17:18], 18, table_b), (tokens_a[9:10], 10, table_a)])
    packed = step(model, cache, [(tokens_a[10:], 11, table_a), (tokens_b[18:], 19, table_b)])

    alone_a = step(model, model.make_kv_cache(NUM_BLOCKS, BLOCK_SIZE), [(tokens_a, 11, table_a)])
    alone_b = step(model, model.make_kv_cache(NUM_BLOCKS, BLOCK_SIZE), [(tokens_b, 19, table_b)])
    torch.testing.assert_close(packed[0], alone_a[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(packed[1], alone_b[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(packed[0], reference_logits(model, tokens_a)[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(packed[1], reference_logits(model, tokens_b)[-1], atol=ATOL, rtol=0)


def test_step_rejects_tokens_not_covered_by_sequences(model: GPT2LMHeadModel) -> None:
    cache = model.make_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    with pytest.raises(GPT2StepError, match="cover 2 tokens"):
        model(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2]), [StepSequence(0, 2, 2, [0])], cache)
    with pytest.raises(GPT2StepError, match="needs 2 blocks"):
        step(model, cache, [(list(range(9)), 9, [0])])


def test_slot_mapping_hand_computed() -> None:
    # block_size 4, block_table [5, 2, 9]: position p -> table[p // 4] * 4 + p % 4.
    positions = torch.tensor([0, 3, 4, 7, 8, 10])
    slots = slot_mapping([5, 2, 9], positions, block_size=4)
    assert slots.tolist() == [20, 23, 8, 11, 36, 38]
    assert slot_mapping(torch.tensor([1]), torch.tensor([2]), block_size=8).tolist() == [10]
    assert slot_mapping([0, 7, 3], torch.tensor([16, 15]), block_size=8).tolist() == [24, 63]


def test_slot_mapping_rejects_positions_beyond_block_table() -> None:
    with pytest.raises(KVCacheError, match="need 3 blocks"):
        slot_mapping([5, 2], torch.tensor([8]), block_size=4)


def test_cache_write_then_gather_returns_positions_in_order() -> None:
    cache = KVCache(
        num_layers=1, num_blocks=6, block_size=2, num_kv_heads=1, head_dim=1,
        dtype=torch.float32, device="cpu",
    )  # fmt: skip
    block_table = [4, 1, 3]
    positions = torch.arange(5)
    values = (positions.float() + 1).view(5, 1, 1)
    cache.write(0, cache.slot_mapping(block_table, positions), values, -values)
    k, v = cache.gather(0, block_table, context_len=5)
    assert k.flatten().tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert v.flatten().tolist() == [-1.0, -2.0, -3.0, -4.0, -5.0]
    assert cache.k[0][4].flatten().tolist() == [1.0, 2.0]
    assert cache.k[0][0].abs().sum() == 0


def test_mixed_step_of_chunks_and_decodes_ignores_nan_in_unused_cache_slots(
    model: GPT2LMHeadModel,
) -> None:
    # Two chunks of different lengths (one continuing its context) and two decodes attend
    # in one step, over blocks whose unused slots (and every other block) hold NaN, as a
    # failed request could leave them: every row must still match the reference.
    tokens = [random_tokens(n, seed=20 + n) for n in (7, 21, 12, 18)]
    tables = [[3], [8, 1, 14], [5, 0], [2, 11, 6]]
    cache = model.make_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    for layer in range(CONFIG.n_layer):
        cache.k[layer].fill_(float("nan"))
        cache.v[layer].fill_(float("nan"))
    step(model, cache, [(tokens[1][:10], 10, tables[1]), (tokens[2][:11], 11, tables[2])])
    step(model, cache, [(tokens[3][:17], 17, tables[3])])
    mixed = step(
        model,
        cache,
        [
            (tokens[0], 7, tables[0]),  # a whole prompt
            (tokens[2][11:], 12, tables[2]),  # a decode
            (tokens[1][10:], 21, tables[1]),  # a chunk after 10 cached tokens
            (tokens[3][17:], 18, tables[3]),  # a decode
        ],
    )
    assert torch.isfinite(mixed).all()
    for row, ids in enumerate([tokens[0], tokens[2], tokens[1], tokens[3]]):
        torch.testing.assert_close(mixed[row], reference_logits(model, ids)[-1], atol=ATOL, rtol=0)
