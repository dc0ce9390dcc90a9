"""Speculative decoding in the engine: greedy output token for token the target's own under
batching, preemption, prefix caching and chunked prefill; stop strings, EOS and max_tokens
inside an accepted run end the output where they would without it; rejected tokens' blocks
and every block of an aborted request go back; a request can opt out."""

from __future__ import annotations

import copy
import random

import pytest
import scipy.stats
import torch

from sluice.engine.engine import Engine, EngineConfig, RequestOutput
from sluice.engine.models import GPT2Config, GPT2LMHeadModel
from sluice.engine.sampler import filter_logits
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.speculative import SpeculativeConfig
from tests.engine.test_engine import (
    BLOCK_SIZE,
    MODEL_CONFIG,
    assert_no_leak,
    naive_greedy,
    run_to_completion,
    text_of,
    tokens_of,
)
from tests.engine.test_native_draft import last_logits
from tests.engine.tiny_models import varied_gpt2

# Drafting in C (a GPT-2 draft, greedy) and by the torch rounds, attention either way.
pytestmark = pytest.mark.usefixtures("kernel_path")

GREEDY = SamplingParams(max_tokens=16, temperature=0)
# A draft of the same vocabulary and positions, half the size: it mostly disagrees.
DRAFT_CONFIG = GPT2Config(vocab_size=101, n_positions=256, n_embd=32, n_layer=1, n_head=2)


@pytest.fixture(scope="module")
def model() -> GPT2LMHeadModel:
    return varied_gpt2(MODEL_CONFIG)


@pytest.fixture(scope="module")
def other_draft() -> GPT2LMHeadModel:
    return varied_gpt2(DRAFT_CONFIG, seed=3)


def make_engine(
    model: GPT2LMHeadModel,
    speculation: SpeculativeConfig | None,
    draft: GPT2LMHeadModel | None = None,
    *,
    num_blocks: int = 64,
    max_num_batched_tokens: int = 64,
    eos_token_id: int | None = None,
) -> Engine:
    config = EngineConfig(
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        max_num_seqs=8,
        max_num_batched_tokens=max_num_batched_tokens,
        max_waiting=64,
        max_model_len=min(128, num_blocks * BLOCK_SIZE),
    )
    return Engine(
        model,
        config,
        eos_token_id=eos_token_id,
        token_bytes=lambda t: f"{t:03d}|".encode(),
        speculation=speculation,
        draft_model=draft,
    )


def fixed_k(method: str, k: int = 4) -> SpeculativeConfig:
    return SpeculativeConfig(method, k, adaptive=False)  # type: ignore[arg-type]


def speculating_engines(
    model: GPT2LMHeadModel,
    other_draft: GPT2LMHeadModel,
    *,
    num_blocks: int = 64,
    max_num_batched_tokens: int = 64,
) -> dict[str, Engine]:
    """One engine per way of drafting: the target as its own draft (every draft accepted),
    a draft that mostly disagrees (rejections), prompt lookup, and adaptive k."""
    limits = {"num_blocks": num_blocks, "max_num_batched_tokens": max_num_batched_tokens}
    return {
        "self-draft": make_engine(model, fixed_k("draft"), model, **limits),
        "other-draft": make_engine(model, fixed_k("draft", 3), other_draft, **limits),
        "ngram": make_engine(model, fixed_k("ngram", 3), None, **limits),
        "adaptive": make_engine(model, SpeculativeConfig("draft", 4), other_draft, **limits),
    }


def test_greedy_output_is_the_targets_with_every_way_of_drafting(
    model: GPT2LMHeadModel, other_draft: GPT2LMHeadModel
) -> None:
    prompts = [[5], [1, 2, 3, 1, 2, 3, 1, 2], [7, 99, 3, 14, 15, 92, 65, 35, 89, 79, 32, 38]]
    expected = [naive_greedy(model, prompt, GREEDY.max_tokens) for prompt in prompts]
    for name, engine in speculating_engines(model, other_draft).items():
        ids = [engine.add_request(prompt, GREEDY) for prompt in prompts]
        outputs = run_to_completion(engine)
        assert [tokens_of(outputs[i]) for i in ids] == expected, name
        assert all(outputs[i][-1].finish_reason == "length" for i in ids), name
        assert [o.num_completion_tokens for o in outputs[ids[0]]][-1] == GREEDY.max_tokens
        assert engine.spec_stats is not None
        assert engine.spec_stats.num_draft_tokens > 0, name
        assert_no_leak(engine)
    engine = make_engine(model, fixed_k("draft"), model)
    request_id = engine.add_request(prompts[2], GREEDY)
    alone = run_to_completion(engine)[request_id]
    assert len(alone) < GREEDY.max_tokens // 2  # several tokens a step
    assert engine.spec_stats is not None
    assert engine.spec_stats.acceptance_rate > 0.9


def test_preemption_prefix_hits_and_chunked_prefill_keep_greedy_output(
    model: GPT2LMHeadModel, other_draft: GPT2LMHeadModel
) -> None:
    rng = random.Random(7)
    prefix = [11, 22, 33, 44, 55, 66, 77, 88]
    requests = [
        (prefix[: rng.choice([0, 4, 8])] + [rng.randrange(101) for _ in range(rng.randint(1, 9))])
        for _ in range(14)
    ]
    max_tokens = [rng.randint(1, 20) for _ in requests]
    for name, engine in speculating_engines(
        model, other_draft, num_blocks=12, max_num_batched_tokens=12
    ).items():
        ids = {
            engine.add_request(prompt, SamplingParams(max_tokens=n, temperature=0)): (prompt, n)
            for prompt, n in zip(requests, max_tokens, strict=True)
        }
        outputs: dict[int, list[RequestOutput]] = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                outputs.setdefault(output.request_id, []).append(output)
            for seq in engine.scheduler.running:  # rejected drafts' blocks went back
                assert seq.num_lookahead_blocks == 0
                assert len(seq.block_table) == seq.num_blocks
        for request_id, (prompt, n) in ids.items():
            assert tokens_of(outputs[request_id]) == naive_greedy(model, prompt, n), name
        assert engine.scheduler.num_preemptions > 0, name
        assert engine.block_manager_stats().num_prefix_hits > 0, name
        assert_no_leak(engine)


def ended_at(
    engine: Engine, prompt: list[int], params: SamplingParams
) -> tuple[list[int], str, str | None, str | None]:
    request_id = engine.add_request(prompt, params)
    outputs = run_to_completion(engine)[request_id]
    assert_no_leak(engine)
    return (
        tokens_of(outputs),
        text_of(outputs),
        outputs[-1].finish_reason,
        outputs[-1].stop_sequence,
    )


def test_a_stop_string_inside_an_accepted_run_ends_the_output_where_it_would_without(
    model: GPT2LMHeadModel,
) -> None:
    prompt = [2, 7, 1, 8, 2, 8]
    reference = naive_greedy(model, prompt, 16)
    for index in (2, 5, 9):  # spans the end of token ``index`` and the start of the next
        stop = f"{reference[index]:03d}|"[2:] + f"{reference[index + 1]:03d}|"[:2]
        params = SamplingParams(max_tokens=16, temperature=0, stop=[stop])
        without = ended_at(make_engine(model, None), prompt, params)
        assert ended_at(make_engine(model, fixed_k("draft"), model), prompt, params) == without
        assert without[2] == "stop"
        assert stop not in without[1]


def test_eos_and_max_tokens_inside_an_accepted_run_end_it_there(model: GPT2LMHeadModel) -> None:
    prompt = [3, 1, 4, 1, 5]
    reference = naive_greedy(model, prompt, 16)
    eos = reference[6]
    params = SamplingParams(max_tokens=16, temperature=0)
    without = ended_at(make_engine(model, None, eos_token_id=eos), prompt, params)
    spec = make_engine(model, fixed_k("draft"), model, eos_token_id=eos)
    assert ended_at(spec, prompt, params) == without
    assert without[2] == "stop"
    assert len(without[0]) == reference.index(eos) + 1
    short = SamplingParams(max_tokens=3, temperature=0)
    assert ended_at(make_engine(model, fixed_k("draft"), model), prompt, short)[0] == reference[:3]


def test_abort_in_any_state_frees_the_target_and_draft_blocks(
    model: GPT2LMHeadModel, other_draft: GPT2LMHeadModel
) -> None:
    rng = random.Random(11)
    for engine in speculating_engines(model, other_draft, num_blocks=24).values():
        live: list[int] = []
        for step in range(60):
            if rng.random() < 0.6:
                prompt = [rng.randrange(101) for _ in range(rng.randint(1, 12))]
                live.append(
                    engine.add_request(prompt, SamplingParams(max_tokens=20, temperature=0))
                )
            if live and rng.random() < 0.3:
                engine.abort(live.pop(rng.randrange(len(live))))
            engine.step()
            if step % 20 == 19:
                for request_id in live:
                    engine.abort(request_id)
                live.clear()
                assert_no_leak(engine)


def test_sampled_speculation_finishes_with_tokens_of_the_vocabulary(
    model: GPT2LMHeadModel, other_draft: GPT2LMHeadModel
) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.8, top_k=20, seed=5, logprobs=True)
    for engine in speculating_engines(model, other_draft).values():
        request_id = engine.add_request([9, 8, 7, 6], params)
        outputs = run_to_completion(engine)[request_id]
        tokens = tokens_of(outputs)
        assert len(tokens) == 24
        assert all(0 <= t < 101 for t in tokens)
        logprobs = [lp for output in outputs for lp in output.logprobs or ()]
        assert len(logprobs) == 24
        assert all(lp <= 0 for lp in logprobs)
        assert_no_leak(engine)


def target_distribution(
    model: GPT2LMHeadModel, prompt: list[int], params: SamplingParams, length: int
) -> dict[tuple[int, ...], float]:
    """The probability of each run of ``length`` tokens after ``prompt`` under ``params``,
    from the target's own logits (whole sequences recomputed)."""
    runs: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(length):
        longer: dict[tuple[int, ...], float] = {}
        for run, probability in runs.items():
            p = torch.softmax(filter_logits(last_logits(model, prompt + list(run)), params), -1)
            for token in torch.nonzero(p).flatten().tolist():
                longer[(*run, token)] = probability * float(p[token])
        runs = longer
    return runs


def test_sampled_speculation_keeps_the_targets_distribution(model: GPT2LMHeadModel) -> None:
    """The four tokens of 2,400 requests, sampled with a draft that partly agrees (4 at a
    time: the C drafter's batch, or the torch rounds), against the target's own joint
    distribution of them: a chi-square test at 0.1%. Token 1 is the prefill's, 2-4 are
    speculated (accepted drafts, corrections and bonuses)."""
    torch.manual_seed(0)
    params = SamplingParams(max_tokens=4, temperature=1.5, top_k=2, ignore_eos=True)
    prompt = [9, 8, 7, 6]
    expected = target_distribution(model, prompt, params, 4)
    draft = copy.deepcopy(model)  # the target's weights, perturbed: q near p, not p
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(0.3 * parameter.std() * torch.randn_like(parameter))
    engine = make_engine(model, fixed_k("draft", 3), draft)
    counts = dict.fromkeys(expected, 0)
    for _ in range(600):
        request_ids = [engine.add_request(prompt, params) for _ in range(4)]
        outputs = run_to_completion(engine)
        for request_id in request_ids:
            run = tuple(tokens_of(outputs[request_id]))
            assert run in counts, f"{run} has no probability under the target"
            counts[run] += 1
    stats = engine.spec_stats
    assert stats is not None
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    runs = sorted(expected)
    observed = [counts[run] for run in runs]
    total = sum(expected.values())  # 1 up to float32's rounding
    result = scipy.stats.chisquare(
        observed, [expected[run] / total * sum(observed) for run in runs]
    )
    assert result.pvalue > 1e-3, (observed, [round(expected[run], 4) for run in runs])
    assert_no_leak(engine)


def test_a_request_that_opts_out_never_speculates(model: GPT2LMHeadModel) -> None:
    engine = make_engine(model, fixed_k("draft"), model)
    params = SamplingParams(max_tokens=10, temperature=0, speculative=False)
    request_id = engine.add_request([1, 2, 3], params)
    outputs = run_to_completion(engine)[request_id]
    assert tokens_of(outputs) == naive_greedy(model, [1, 2, 3], 10)
    assert len(outputs) == 10
    assert engine.spec_stats is not None
    assert engine.spec_stats.num_drafts == 0


def test_the_engine_refuses_a_draft_that_does_not_fit(model: GPT2LMHeadModel) -> None:
    small_vocab = varied_gpt2(
        GPT2Config(vocab_size=50, n_positions=256, n_embd=32, n_layer=1, n_head=2)
    )
    with pytest.raises(ValueError, match="vocabulary"):
        make_engine(model, fixed_k("draft"), small_vocab)
    with pytest.raises(ValueError, match="needs a draft model"):
        make_engine(model, fixed_k("draft"))
    with pytest.raises(ValueError, match="takes no draft model"):
        make_engine(model, fixed_k("ngram"), model)


def record_steady(engine: Engine, k: int) -> list[bool]:
    """Make ``engine``'s adaptive k (a test double from here on) choose ``k`` every step;
    the list it returns fills with whether each observed step was steady."""
    assert engine.speculator is not None
    assert engine.speculator.adaptive_k is not None
    policy = engine.speculator.adaptive_k
    steady: list[bool] = []
    policy.choose = lambda *args: k  # type: ignore[method-assign]
    policy.observe = lambda *args, **kwargs: steady.append(kwargs["steady"])  # type: ignore[method-assign]
    return steady


def test_a_step_drafting_well_under_its_k_is_no_sample_of_its_cost(
    model: GPT2LMHeadModel,
) -> None:
    """Near max_tokens a sequence drafts fewer than k tokens: that step is cheaper than a
    step of k, and adaptive k does not take it as one (the cheapest sample is the estimate)."""
    engine = make_engine(model, SpeculativeConfig("draft", 4), model)  # self-draft: all kept
    steady = record_steady(engine, k=4)
    request_id = engine.add_request([1, 2, 3], SamplingParams(max_tokens=14, temperature=0))
    outputs = run_to_completion(engine)[request_id]
    # The prompt's step gives 1 token, a step of 4 drafts 5 (the first one's draft catches
    # up on the prompt: not steady either); the last has room for 2 drafts.
    assert [len(output.new_token_ids) for output in outputs] == [1, 5, 5, 3]
    assert steady == [False, True, False]


def test_a_step_whose_prompt_lookup_finds_nothing_is_no_sample_of_its_cost(
    model: GPT2LMHeadModel,
) -> None:
    """A step of k where prompt lookup drafted nothing ran a plain decode: it is no measure
    of a step of k."""
    engine = make_engine(model, SpeculativeConfig("ngram", 2), None)
    steady = record_steady(engine, k=2)
    assert engine.speculator is not None
    engine.speculator.proposer.propose = lambda requests: {}  # type: ignore[method-assign]
    request_id = engine.add_request([1, 2, 3], SamplingParams(max_tokens=6, temperature=0))
    outputs = run_to_completion(engine)[request_id]
    assert tokens_of(outputs) == naive_greedy(model, [1, 2, 3], 6)
    assert steady == [False] * 5  # every decode step: a token each, no drafts
