"""Our models against Hugging Face ``transformers``, a reference no one here wrote.

For the bundled ``sluice-tiny`` GPT-2, a random GPT-2 and a random grouped-query Llama (both
initialised and saved by ``transformers`` itself): logits of a whole-prompt prefill, of
chunked prefill, and of token-by-token decode through the paged cache (block tables in a
scrambled order) match ``transformers``' fp32 logits within 1e-4; the engine's greedy tokens
equal ``generate(do_sample=False)`` token for token.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import transformers

from sluice.engine.engine import Engine, EngineConfig
from sluice.engine.loader import Checkpoint, load_checkpoint
from sluice.engine.models import StepSequence
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.tokenizer import Tokenizer
from tests.tiny_tokenizer import train_tokenizer

BUNDLED_MODEL = Path(__file__).resolve().parents[2] / "models" / "sluice-tiny"
BLOCK_SIZE = 4
ATOL = 1e-4
TEXT = (
    "Return a new socket object connected to the given address. If the timeout is set, "
    "the call fails when no connection is made in time."
)
CORPUS = [TEXT, "Streams of tokens arrive one by one; nothing is lost.", "café 東京 🙂"] * 20


def _save_random(directory: Path, config: transformers.PretrainedConfig) -> Path:
    """A model initialised by ``transformers`` with wide weights, saved in its own format."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # HF's 0.02 init gives near-uniform logits; widen it so they differ
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.25)
            elif "norm" in name or "ln_" in name:
                param.uniform_(0.8, 1.2)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module", params=["bundled-gpt2", "random-gpt2", "random-llama"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if request.param == "bundled-gpt2":
        return BUNDLED_MODEL
    directory = tmp_path_factory.mktemp(request.param)
    train_tokenizer(directory / "tokenizer.json", CORPUS)
    vocab = Tokenizer.from_file(directory / "tokenizer.json").vocab_size
    config: transformers.PretrainedConfig
    if request.param == "random-gpt2":
        config = transformers.GPT2Config(
            vocab_size=vocab, n_positions=128, n_embd=64, n_layer=2, n_head=4
        )
    else:
        config = transformers.LlamaConfig(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            max_position_embeddings=128,
            rope_theta=50000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        )
    return _save_random(directory, config)


@pytest.fixture(scope="module")
def pair(model_dir: Path) -> tuple[Checkpoint, transformers.PreTrainedModel]:
    ours = load_checkpoint(model_dir)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    theirs.generation_config.eos_token_id = None  # both sides run the full max_new_tokens
    return ours, theirs.eval()


def _prompt(checkpoint: Checkpoint) -> list[int]:
    return checkpoint.tokenizer.encode(TEXT)[:40]


def _reference_logits(theirs: transformers.PreTrainedModel, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits: torch.Tensor = theirs(torch.tensor([ids])).logits[0]
    return logits


def _scrambled_blocks(num_tokens: int, seed: int) -> list[int]:
    """A block table covering ``num_tokens`` whose blocks are out of order in the cache."""
    blocks = list(range(-(-num_tokens // BLOCK_SIZE) + 3))
    random.Random(seed).shuffle(blocks)
    return blocks


@pytest.mark.parametrize("chunk", [None, 1, 3, 7], ids=["whole", "by-1", "by-3", "by-7"])
def test_paged_logits_match_transformers(
    pair: tuple[Checkpoint, transformers.PreTrainedModel], chunk: int | None
) -> None:
    """Prefill in chunks of ``chunk`` tokens (one at a time is decode); each chunk's last
    logits equal the reference's at that position."""
    checkpoint, theirs = pair
    ids = _prompt(checkpoint)
    assert len(ids) >= 20
    expected = _reference_logits(theirs, ids)
    blocks = _scrambled_blocks(len(ids), seed=len(ids) + (chunk or 0))
    cache = checkpoint.model.make_kv_cache(max(blocks) + 1, BLOCK_SIZE)
    size = chunk or len(ids)
    with torch.inference_mode():
        for start in range(0, len(ids), size):
            new = ids[start : start + size]
            end = start + len(new)
            step = StepSequence(0, len(new), end, blocks)
            logits = checkpoint.model(torch.tensor(new), torch.arange(start, end), [step], cache)
            torch.testing.assert_close(logits[0], expected[end - 1], atol=ATOL, rtol=0)


def test_batched_step_logits_match_transformers(
    pair: tuple[Checkpoint, transformers.PreTrainedModel],
) -> None:
    """Three sequences packed in one step (a prefill and two continuing ones)."""
    checkpoint, theirs = pair
    ids = _prompt(checkpoint)
    prompts = [ids[:9], ids[5:30], ids[::2]]
    num_blocks = sum(-(-len(p) // BLOCK_SIZE) for p in prompts)
    cache = checkpoint.model.make_kv_cache(num_blocks, BLOCK_SIZE)
    order = list(range(num_blocks))
    random.Random(3).shuffle(order)
    tables, taken = [], 0
    for p in prompts:
        n = -(-len(p) // BLOCK_SIZE)
        tables.append(order[taken : taken + n])
        taken += n
    with torch.inference_mode():
        # First step: the second and third sequences prefill all but their last 2 tokens.
        firsts = [p[:-2] for p in prompts[1:]]
        steps, start = [], 0
        for p, table in zip(firsts, tables[1:], strict=True):
            steps.append(StepSequence(start, len(p), len(p), table))
            start += len(p)
        positions = torch.cat([torch.arange(len(p)) for p in firsts])
        checkpoint.model(torch.tensor([t for p in firsts for t in p]), positions, steps, cache)
        # Second step: the first sequence's whole prompt, the others' last two tokens.
        news = [prompts[0], prompts[1][-2:], prompts[2][-2:]]
        steps, start = [], 0
        for p, new, table in zip(prompts, news, tables, strict=True):
            steps.append(StepSequence(start, len(new), len(p), table))
            start += len(new)
        positions = torch.cat(
            [torch.arange(len(p) - len(new), len(p)) for p, new in zip(prompts, news, strict=True)]
        )
        logits = checkpoint.model(
            torch.tensor([t for new in news for t in new]), positions, steps, cache
        )
    for row, p in zip(logits, prompts, strict=True):
        torch.testing.assert_close(row, _reference_logits(theirs, p)[-1], atol=ATOL, rtol=0)


def test_engine_greedy_tokens_equal_transformers_generate(
    pair: tuple[Checkpoint, transformers.PreTrainedModel],
) -> None:
    checkpoint, theirs = pair
    num_new = 24
    prompts = [_prompt(checkpoint)[:n] for n in (3, 11, 26)]
    config = EngineConfig(
        num_blocks=64,
        block_size=BLOCK_SIZE,
        max_num_seqs=4,
        max_num_batched_tokens=16,  # the longest prompt prefills in chunks
        max_waiting=8,
        max_model_len=64,
    )
    engine = Engine(checkpoint.model, config, eos_token_id=None, token_bytes=lambda t: b"x")
    params = SamplingParams(max_tokens=num_new, temperature=0)
    request_ids = [engine.add_request(p, params) for p in prompts]
    ours: dict[int, list[int]] = {r: [] for r in request_ids}
    while engine.has_unfinished_requests():
        for output in engine.step():
            ours[output.request_id] += output.new_token_ids
    for request_id, prompt in zip(request_ids, prompts, strict=True):
        with torch.inference_mode():
            generated = theirs.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=num_new,
                pad_token_id=0,
            )
        assert ours[request_id] == generated[0, len(prompt) :].tolist()
