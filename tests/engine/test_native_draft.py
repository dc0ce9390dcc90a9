"""A GPT-2 draft's rounds in C draft what the torch rounds draft, and write the same K/V to
the draft's paged cache; sampled, each draft is the inverse CDF of the ``q`` it returns
at a uniform of the request's generator, and that ``q`` is the torch sampler's.

The torch side is the model's own ``decode`` over :class:`DecodeRounds`, as
:class:`~sluice.engine.proposer.DraftModelProposer` runs it without the kernel; the C side
is :class:`NativeDraft` on a second cache filled by the same prefill.
"""

from __future__ import annotations

import random

import pytest
import torch

from sluice.engine.kv_cache import KVCache
from sluice.engine.model_runner import ModelRunner, ModelSlice
from sluice.engine.models import GPT2Config, GPT2LMHeadModel, StepError
from sluice.engine.models.decode import DecodeRounds
from sluice.engine.models.native_build import NativeKernelError
from sluice.engine.models.native_draft import NativeDraft
from sluice.engine.models.step import StepSequence
from sluice.engine.sampler import filter_logits
from sluice.engine.sampling_params import SamplingParams
from tests.engine.tiny_models import varied_gpt2

CONFIG = GPT2Config(vocab_size=203, n_positions=96, n_embd=48, n_layer=2, n_head=3)
BLOCK_SIZE = 4
NUM_BLOCKS = 96


def half_representable(model: GPT2LMHeadModel) -> GPT2LMHeadModel:
    """The kernel reads a draft's matrices in float16 (on a CPU with F16C): weights that
    float16 holds exactly make its arithmetic the torch rounds' up to summation order."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(parameter.half().float())
    return model


@pytest.fixture(scope="module")
def model() -> GPT2LMHeadModel:
    return half_representable(varied_gpt2(CONFIG, seed=5))


def torch_rounds(
    runner: ModelRunner,
    catch_up: list[list[int]],
    firsts: list[int],
    counts: list[int],
    tables: list[list[int]],
) -> list[list[int]]:
    """The drafts of the torch rounds: the catch-up slices in one forward, then decodes."""
    drafts: list[list[int]] = [[] for _ in catch_up]
    with torch.inference_mode():
        logits = runner.forward(
            [
                ModelSlice(tokens, first, table)
                for tokens, first, table in zip(catch_up, firsts, tables, strict=True)
            ]
        )
        ids = logits.argmax(dim=-1)
        ends = [first + len(tokens) - 1 for tokens, first in zip(catch_up, firsts, strict=True)]
        rounds = DecodeRounds(
            tables, ends, counts, runner.kv_cache, max_positions=CONFIG.n_positions
        )
        for round_ in range(max(counts)):
            rows = [i for i, count in enumerate(counts) if count > round_]
            for i in rows:
                drafts[i].append(int(ids[i]))
            if round_ + 1 < max(counts):
                next_rows = [i for i in rows if counts[i] > round_ + 1]
                layout = rounds.layout(
                    round_ + 1, next_rows if len(next_rows) < len(counts) else None
                )
                logits = runner.decode(torch.tensor([drafts[i][-1] for i in next_rows]), layout)
                full = torch.zeros(len(counts), dtype=torch.long)
                full[next_rows] = logits.argmax(dim=-1)
                ids = full
    return drafts


def two_caches(model: GPT2LMHeadModel) -> tuple[ModelRunner, ModelRunner]:
    return (
        ModelRunner(model, model.make_kv_cache(NUM_BLOCKS, BLOCK_SIZE)),
        ModelRunner(model, model.make_kv_cache(NUM_BLOCKS, BLOCK_SIZE)),
    )


def test_drafts_and_written_kv_equal_the_torch_rounds(model: GPT2LMHeadModel) -> None:
    rng = random.Random(3)
    blocks = list(range(NUM_BLOCKS))
    rng.shuffle(blocks)
    reference, native_runner = two_caches(model)
    drafter = NativeDraft.for_model(model, native_runner.kv_cache)
    assert drafter is not None
    # Prompts already in both caches, then catch-ups of 1, 2 and 5 tokens and 1-4 drafts.
    prompt_lens, catch_up_lens, counts = [9, 30, 3], [1, 2, 5], [4, 1, 3]
    tables, catch_up, firsts = [], [], []
    for prompt_len, num_catch_up, count in zip(prompt_lens, catch_up_lens, counts, strict=True):
        num_blocks = -(-(prompt_len + num_catch_up + count) // BLOCK_SIZE)
        table, blocks = blocks[:num_blocks], blocks[num_blocks:]
        prompt = [rng.randrange(CONFIG.vocab_size) for _ in range(prompt_len)]
        for runner in (reference, native_runner):
            runner.forward([ModelSlice(prompt, 0, table)])
        tables.append(table)
        catch_up.append([rng.randrange(CONFIG.vocab_size) for _ in range(num_catch_up)])
        firsts.append(prompt_len)
    expected = torch_rounds(reference, catch_up, firsts, counts, tables)
    assert drafter.draft(catch_up, firsts, counts, tables).tokens == expected
    for layer in range(CONFIG.n_layer):
        for torch_cache, c_cache in (
            (reference.kv_cache.flat_k[layer], native_runner.kv_cache.flat_k[layer]),
            (reference.kv_cache.flat_v[layer], native_runner.kv_cache.flat_v[layer]),
        ):
            torch.testing.assert_close(c_cache, torch_cache, atol=1e-5, rtol=0)


def test_a_reloaded_weight_is_read_not_the_old_one(model: GPT2LMHeadModel) -> None:
    changed = half_representable(varied_gpt2(CONFIG, seed=5))
    reference, native_runner = two_caches(changed)
    drafter = NativeDraft.for_model(changed, native_runner.kv_cache)
    assert drafter is not None
    table = list(range(8))
    before = drafter.draft([[1, 2, 3]], [0], [4], [table]).tokens
    changed.load_state_dict(half_representable(varied_gpt2(CONFIG, seed=9)).state_dict())
    after = drafter.draft([[1, 2, 3]], [0], [4], [table]).tokens
    assert after == torch_rounds(reference, [[1, 2, 3]], [0], [4], [table])
    assert after != before


def last_logits(model: GPT2LMHeadModel, token_ids: list[int]) -> torch.Tensor:
    """The next-token logits after ``token_ids``, the whole sequence recomputed."""
    n = len(token_ids)
    cache = model.make_kv_cache(-(-n // BLOCK_SIZE), BLOCK_SIZE)
    step = StepSequence(0, n, n, list(range(cache.num_blocks)))
    with torch.inference_mode():
        return model(torch.tensor(token_ids), torch.arange(n), [step], cache)[0]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=0.9, top_p=0.8),
        SamplingParams(temperature=1.0, top_k=40, top_p=0.95),
    ],
    ids=["temperature", "top-k", "top-p", "top-k-and-top-p"],
)
def test_sampled_drafts_are_drawn_from_the_q_they_return(
    model: GPT2LMHeadModel, params: SamplingParams
) -> None:
    _, runner = two_caches(model)
    drafter = NativeDraft.for_model(model, runner.kv_cache)
    assert drafter is not None
    rng = random.Random(11)
    prompt = [rng.randrange(CONFIG.vocab_size) for _ in range(10)]
    greedy_prompt = [rng.randrange(CONFIG.vocab_size) for _ in range(6)]
    tables = [list(range(0, 6)), list(range(6, 12))]
    runner.forward([ModelSlice(prompt, 0, tables[0]), ModelSlice(greedy_prompt, 0, tables[1])])
    catch_up = [[4, 9], [7]]
    for seed in range(6):  # six draws of the same four drafts
        drafts = drafter.draft(
            catch_up,
            [len(prompt), len(greedy_prompt)],
            [4, 3],
            tables,
            [params, SamplingParams(temperature=0)],
            [torch.Generator().manual_seed(seed), None],
        )
        assert drafts.probs is not None
        assert drafts.probs.shape == (2, 4, CONFIG.vocab_size)
        uniforms = torch.rand(4, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        tokens = drafts.tokens[0]
        for d, token in enumerate(tokens):
            logits = last_logits(model, prompt + catch_up[0] + tokens[:d])
            expected = torch.softmax(filter_logits(logits, params), dim=-1)
            q = drafts.probs[0, d]
            torch.testing.assert_close(q, expected, atol=2e-5, rtol=1e-3)
            assert torch.equal(q > 0, expected > 0)  # the same tokens kept
            cdf = q.double().cumsum(0)
            assert token == int(torch.searchsorted(cdf, uniforms[d] * cdf[-1], right=True))
        # The greedy sequence in the same call drafts its argmaxes and has no q.
        greedy = drafts.tokens[1]
        for d, token in enumerate(greedy):
            logits = last_logits(model, greedy_prompt + catch_up[1] + greedy[:d])
            assert token == int(torch.argmax(logits))
        assert not drafts.probs[1].any()


@pytest.mark.parametrize(
    "changes",
    [{"top_p": 1.5}, {"top_p": 0.0}, {"top_k": -1}, {"temperature": float("inf")}],
    ids=["top-p-over-1", "top-p-0", "negative-top-k", "infinite-temperature"],
)
def test_sampling_params_out_of_range_are_refused(
    model: GPT2LMHeadModel, changes: dict[str, float]
) -> None:
    _, runner = two_caches(model)
    drafter = NativeDraft.for_model(model, runner.kv_cache)
    assert drafter is not None
    params = SamplingParams(temperature=0.5)
    for name, value in changes.items():  # past the constructor's own checks
        object.__setattr__(params, name, value)
    with pytest.raises(StepError, match="refused"):
        drafter.draft([[1]], [0], [2], [[0, 1]], [params], [None])


def test_a_draft_past_the_models_positions_is_refused(model: GPT2LMHeadModel) -> None:
    _, runner = two_caches(model)
    drafter = NativeDraft.for_model(model, runner.kv_cache)
    assert drafter is not None
    table = list(range(CONFIG.n_positions // BLOCK_SIZE))
    with pytest.raises(StepError, match="refused"):
        drafter.draft([[1]], [CONFIG.n_positions - 2], [3], [table])


def test_a_block_outside_the_cache_is_refused_not_written(model: GPT2LMHeadModel) -> None:
    _, runner = two_caches(model)
    drafter = NativeDraft.for_model(model, runner.kv_cache)
    assert drafter is not None
    before = [flat.clone() for flat in runner.kv_cache.flat_k]
    with pytest.raises(NativeKernelError, match="outside"):
        drafter.draft([[1, 2]], [0], [2], [[NUM_BLOCKS + 5]])
    assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_cache.flat_k, strict=True))


def test_only_float32_cpu_gpt2_drafts_get_a_drafter(
    model: GPT2LMHeadModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    half = varied_gpt2(CONFIG).to(torch.float16)
    half_cache = KVCache(
        num_layers=CONFIG.n_layer,
        num_blocks=4,
        block_size=BLOCK_SIZE,
        num_kv_heads=CONFIG.n_head,
        head_dim=CONFIG.head_dim,
        dtype=torch.float16,
        device="cpu",
    )
    assert NativeDraft.for_model(half, half_cache) is None
    monkeypatch.setenv("SLUICE_NATIVE_KERNELS", "0")
    assert NativeDraft.for_model(model, model.make_kv_cache(4, BLOCK_SIZE)) is None
