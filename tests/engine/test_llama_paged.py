"""Llama over the paged KV cache matches a plain causal forward pass with the same weights.

The reference below recomputes full causal attention over the whole sequence with no cache,
straight from the state dict (rotary embeddings written out per half, each query head
reading its key/value head by index), so it shares no code with the paged model.
"""

from __future__ import annotations

import pytest
import torch

from sluice.engine.kv_cache import KVCache
from sluice.engine.models import GPT2StepError, LlamaConfig, LlamaForCausalLM, StepSequence

pytestmark = pytest.mark.usefixtures("kernel_path")

CONFIG = LlamaConfig(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)
BLOCK_SIZE = 8
NUM_BLOCKS = 16
ATOL = 1e-5


def make_model(config: LlamaConfig = CONFIG) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    # Larger weights than the default init, and non-trivial norm weights, so that a wrong
    # parameter, rotation or head mapping would show in the logits.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(std=0.15)
    return model


@pytest.fixture
def model() -> LlamaForCausalLM:
    return make_model()


def reference_logits(model: LlamaForCausalLM, token_ids: list[int]) -> torch.Tensor:
    """Logits ``[len(token_ids), vocab]`` by full causal attention, no cache."""
    sd: dict[str, torch.Tensor] = model.state_dict()
    config = model.config
    num_tokens = len(token_ids)
    num_heads = config.num_attention_heads
    num_kv_heads = config.num_key_value_heads
    assert num_kv_heads is not None
    head_dim = config.hidden_size // num_heads
    half = head_dim // 2
    eps = config.rms_norm_eps

    def rms_norm(x: torch.Tensor, key: str) -> torch.Tensor:
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * sd[key]

    def linear(x: torch.Tensor, key: str) -> torch.Tensor:
        return x @ sd[key].T

    # angle[p, j] = p / theta^(2j / head_dim); HF rotates dim j together with dim j + half.
    exponents = torch.arange(half, dtype=torch.float32) * 2 / head_dim
    angles = torch.arange(num_tokens, dtype=torch.float32)[:, None] / (config.rope_theta**exponents)
    cos, sin = angles.cos()[None], angles.sin()[None]  # [1, tokens, half]

    def rope(x: torch.Tensor) -> torch.Tensor:  # [heads, tokens, head_dim]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    hidden = sd["model.embed_tokens.weight"][torch.tensor(token_ids)]
    causal = torch.tril(torch.ones(num_tokens, num_tokens, dtype=torch.bool))
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        x = rms_norm(hidden, f"{p}.input_layernorm.weight")
        q = linear(x, f"{p}.self_attn.q_proj.weight").view(num_tokens, num_heads, head_dim)
        k = linear(x, f"{p}.self_attn.k_proj.weight").view(num_tokens, num_kv_heads, head_dim)
        v = linear(x, f"{p}.self_attn.v_proj.weight").view(num_tokens, num_kv_heads, head_dim)
        q, k, v = rope(q.transpose(0, 1)), rope(k.transpose(0, 1)), v.transpose(0, 1)
        heads = []
        for h in range(num_heads):
            kv = h * num_kv_heads // num_heads
            scores = q[h] @ k[kv].T / head_dim**0.5
            weights = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
            heads.append(weights @ v[kv])
        attended = torch.cat(heads, dim=-1)
        hidden = hidden + linear(attended, f"{p}.self_attn.o_proj.weight")
        x = rms_norm(hidden, f"{p}.post_attention_layernorm.weight")
        gate = linear(x, f"{p}.mlp.gate_proj.weight")
        up = linear(x, f"{p}.mlp.up_proj.weight")
        hidden = hidden + linear(gate * torch.sigmoid(gate) * up, f"{p}.mlp.down_proj.weight")
    return rms_norm(hidden, "model.norm.weight") @ sd["lm_head.weight"].T


def step(
    model: LlamaForCausalLM,
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


def test_state_dict_uses_hugging_face_names_and_shapes(model: LlamaForCausalLM) -> None:
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    expected = {
        "model.embed_tokens.weight": (97, 64),
        "model.norm.weight": (64,),
        "lm_head.weight": (97, 64),
    }
    for i in range(2):
        p = f"model.layers.{i}"
        expected |= {
            f"{p}.input_layernorm.weight": (64,),
            f"{p}.self_attn.q_proj.weight": (64, 64),
            f"{p}.self_attn.k_proj.weight": (32, 64),
            f"{p}.self_attn.v_proj.weight": (32, 64),
            f"{p}.self_attn.o_proj.weight": (64, 64),
            f"{p}.post_attention_layernorm.weight": (64,),
            f"{p}.mlp.gate_proj.weight": (128, 64),
            f"{p}.mlp.up_proj.weight": (128, 64),
            f"{p}.mlp.down_proj.weight": (64, 128),
        }
    assert shapes == expected
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert model.config.n_positions == 128
    cache = model.make_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    assert (cache.num_layers, cache.num_kv_heads, cache.head_dim) == (2, 2, 16)
    assert cache.k[0].dtype == torch.float32


def test_tied_word_embeddings_share_lm_head_and_match_reference() -> None:
    tied_config = LlamaConfig(**{**CONFIG.__dict__, "tie_word_embeddings": True})
    model = make_model(tied_config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    sd = model.state_dict()
    fresh = LlamaForCausalLM(tied_config)
    fresh.load_state_dict(sd)
    assert torch.equal(fresh.lm_head.weight, sd["model.embed_tokens.weight"])
    tokens = random_tokens(13, seed=7)
    logits = step(model, model.make_kv_cache(NUM_BLOCKS, BLOCK_SIZE), [(tokens, 13, [2, 5])])
    torch.testing.assert_close(logits, reference_logits(model, tokens)[-1:], atol=ATOL, rtol=0)


def test_from_hf_config_reads_fields_and_rejects_rope_scaling() -> None:
    raw: dict[str, object] = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 97,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "hidden_act": "silu",
    }
    assert LlamaConfig.from_hf_config(raw) == CONFIG
    defaults = {k: v for k, v in raw.items() if k not in ("num_key_value_heads", "rope_theta")}
    config = LlamaConfig.from_hf_config(defaults)
    assert config.num_key_value_heads == 4
    assert config.rope_theta == 10000.0
    assert config.tie_word_embeddings is False
    tied = LlamaConfig.from_hf_config({**raw, "tie_word_embeddings": True})
    assert tied.tie_word_embeddings is True
    with pytest.raises(ValueError, match="rope_scaling"):
        LlamaConfig.from_hf_config({**raw, "rope_scaling": {"type": "linear", "factor": 2.0}})
    with pytest.raises(ValueError, match="hidden_act"):
        LlamaConfig.from_hf_config({**raw, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="divisible"):
        LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=3)


def test_full_prefill_matches_reference_last_token(model: LlamaForCausalLM) -> None:
    tokens = random_tokens(21, seed=1)
    cache = model.make_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    logits = step(model, cache, [(tokens, 21, [3, 9, 4])])
    expected = reference_logits(model, tokens)
    assert expected[-1].std() > 0.1  # the weights make the logits vary
    torch.testing.assert_close(logits, expected[-1:], atol=ATOL, rtol=0)


def test_decode_one_token_at_a_time_matches_reference_at_every_position(
    model: LlamaForCausalLM,
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


def test_chunked_prefill_matches_single_prefill(model: LlamaForCausalLM) -> None:
    tokens = random_tokens(40, seed=3)
    block_table = [7, 1, 12, 4, 9]
    cache = model.make_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    step(model, cache, [(tokens[:13], 13, block_table)])
    step(model, cache, [(tokens[13:32], 32, block_table)])
    logits = step(model, cache, [(tokens[32:], 40, block_table)])
    whole = step(model, model.make_kv_cache(NUM_BLOCKS, BLOCK_SIZE), [(tokens, 40, block_table)])
    torch.testing.assert_close(logits, whole, atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[0], reference_logits(model, tokens)[-1], atol=ATOL, rtol=0)


def test_packed_sequences_with_interleaved_blocks_match_each_alone(
    model: LlamaForCausalLM,
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


def test_step_rejects_bad_packing_and_short_block_tables(model: LlamaForCausalLM) -> None:
    cache = model.make_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    with pytest.raises(GPT2StepError, match="cover 2 tokens"):
        model(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2]), [StepSequence(0, 2, 2, [0])], cache)
    with pytest.raises(GPT2StepError, match="needs 2 blocks"):
        step(model, cache, [(list(range(9)), 9, [0])])
