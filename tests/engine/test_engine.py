"""The engine end to end on a small random GPT-2: greedy equals a naive loop, batching changes
no request's tokens, abort frees every block in every state, and requests finish for the
right reason with no stop string leaked.

The naive reference reruns the model over the whole growing sequence each step with a fresh
single-sequence cache, so it shares no scheduling, chunking or prefix caching with the engine.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection

import pytest
import torch

from sluice.engine import QueueFullError
from sluice.engine.engine import Engine, EngineConfig, RequestOutput
from sluice.engine.models import GPT2Config, GPT2LMHeadModel, StepSequence
from sluice.engine.sampling_params import SamplingParams
from tests.engine.tiny_models import ascii_bytes, varied_gpt2

MODEL_CONFIG = GPT2Config(vocab_size=101, n_positions=256, n_embd=64, n_layer=2, n_head=4)
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def model() -> GPT2LMHeadModel:
    return varied_gpt2(MODEL_CONFIG)


def make_engine(
    model: GPT2LMHeadModel,
    *,
    num_blocks: int = 64,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_waiting: int = 64,
    max_model_len: int | None = None,
    eos_token_id: int | Collection[int] | None = None,
    token_bytes: Callable[[int], bytes] = ascii_bytes,
) -> Engine:
    config = EngineConfig(
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_waiting=max_waiting,
        max_model_len=min(128, num_blocks * BLOCK_SIZE) if max_model_len is None else max_model_len,
    )
    return Engine(model, config, eos_token_id=eos_token_id, token_bytes=token_bytes)


def naive_greedy(model: GPT2LMHeadModel, prompt: list[int], num_tokens: int) -> list[int]:
    """Argmax of the last position, recomputing the whole sequence every step."""
    token_ids = list(prompt)
    for _ in range(num_tokens):
        n = len(token_ids)
        cache = model.make_kv_cache(-(-n // BLOCK_SIZE), BLOCK_SIZE)
        step = StepSequence(0, n, n, list(range(cache.num_blocks)))
        with torch.inference_mode():
            logits = model(torch.tensor(token_ids), torch.arange(n), [step], cache)
        token_ids.append(int(torch.argmax(logits[0])))
    return token_ids[len(prompt) :]


def run_to_completion(engine: Engine, max_steps: int = 2000) -> dict[int, list[RequestOutput]]:
    outputs: dict[int, list[RequestOutput]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return outputs
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
    raise AssertionError("engine did not finish")


def tokens_of(outputs: list[RequestOutput]) -> list[int]:
    return [t for output in outputs for t in output.new_token_ids]


def text_of(outputs: list[RequestOutput]) -> str:
    return "".join(output.new_text for output in outputs)


def generate_alone(
    model: GPT2LMHeadModel, prompt: list[int], params: SamplingParams, **engine_kwargs: int
) -> list[RequestOutput]:
    engine = make_engine(model, **engine_kwargs)
    request_id = engine.add_request(prompt, params)
    return run_to_completion(engine)[request_id]


def assert_no_leak(engine: Engine) -> None:
    stats = engine.block_manager_stats()
    assert stats.num_free_blocks == stats.num_blocks
    assert stats.num_used_blocks == 0
    assert engine.num_running == engine.num_waiting == engine.num_requests == 0


GREEDY = SamplingParams(max_tokens=12, temperature=0)


@pytest.mark.parametrize(
    "prompt", [[5], [1, 2, 3, 4], [7, 99, 3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46]]
)
def test_greedy_generation_matches_naive_loop(model: GPT2LMHeadModel, prompt: list[int]) -> None:
    outputs = generate_alone(model, prompt, GREEDY, max_num_batched_tokens=5)
    assert tokens_of(outputs) == naive_greedy(model, prompt, 12)
    assert outputs[-1].finished
    assert outputs[-1].finish_reason == "length"
    assert all(not output.finished for output in outputs[:-1])
    assert [output.num_completion_tokens for output in outputs] == list(range(1, 13))
    assert outputs[-1].num_prompt_tokens == len(prompt)


def test_batching_preemption_and_prefix_hits_do_not_change_greedy_tokens(
    model: GPT2LMHeadModel,
) -> None:
    rng = random.Random(1234)
    prefix = [11, 22, 33, 44, 55, 66, 77, 88]
    target = [*prefix, 9, 8, 7]
    target_params = SamplingParams(max_tokens=20, temperature=0)
    expected = tokens_of(generate_alone(model, target, target_params))

    engine = make_engine(model, num_blocks=24, max_num_seqs=8, max_num_batched_tokens=16)
    max_model_len = engine.config.max_model_len
    others: dict[int, tuple[list[int], SamplingParams]] = {}
    target_id: int | None = None
    num_preempted = 0
    running_before: set[int] = set()
    outputs: dict[int, list[RequestOutput]] = {}
    aborted: set[int] = set()
    step = 0
    while step < 30 or engine.has_unfinished_requests():
        if step == 3:
            target_id = engine.add_request(target, target_params)
        if len(others) < 30 and rng.random() < 0.8:
            head = prefix[: rng.choice([0, 4, 8])]
            prompt = head + [rng.randrange(101) for _ in range(rng.randint(1, 10))]
            params = SamplingParams(max_tokens=rng.randint(1, 20), temperature=0)
            assert len(prompt) + params.max_tokens <= max_model_len
            others[engine.add_request(prompt, params)] = (prompt, params)
        live = [
            i for i in others if i not in aborted and not (i in outputs and outputs[i][-1].finished)
        ]
        if live and rng.random() < 0.15:
            victim = rng.choice(live)
            if engine.abort(victim):
                aborted.add(victim)
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
        running_now = {seq.seq_id for seq in engine.scheduler.running}
        waiting_now = {seq.seq_id for seq in engine.scheduler.waiting}
        num_preempted += len(running_before & waiting_now)
        running_before = running_now
        step += 1
        assert step < 3000

    assert target_id is not None
    assert tokens_of(outputs[target_id]) == expected
    assert num_preempted > 0
    assert engine.scheduler.num_preemptions >= num_preempted  # counted for the metrics
    assert engine.block_manager_stats().num_prefix_hits > 0
    finished = [i for i in others if i not in aborted]
    assert len(finished) > 10
    for request_id in finished:
        prompt, params = others[request_id]
        assert tokens_of(outputs[request_id]) == naive_greedy(model, prompt, params.max_tokens)
    assert_no_leak(engine)


def test_abort_waiting_request_frees_nothing_and_forgets_it(model: GPT2LMHeadModel) -> None:
    engine = make_engine(model, max_num_seqs=1)
    first = engine.add_request([1, 2, 3, 4, 5], GREEDY)
    second = engine.add_request([1, 2, 3, 4, 5, 6], GREEDY)
    engine.step()
    assert engine.num_waiting == 1
    used = engine.block_manager_stats().num_used_blocks
    assert engine.abort(second)
    assert not engine.abort(second)
    assert engine.block_manager_stats().num_used_blocks == used
    assert engine.abort(first)
    assert_no_leak(engine)


def test_abort_mid_chunked_prefill_frees_every_block(model: GPT2LMHeadModel) -> None:
    engine = make_engine(model, max_num_batched_tokens=4)
    request_id = engine.add_request(list(range(1, 21)), GREEDY)
    assert engine.step() == []
    (seq,) = engine.scheduler.running
    assert 0 < seq.num_computed_tokens < seq.num_prompt_tokens
    assert engine.abort(request_id)
    assert_no_leak(engine)
    # The cache entries of the unwritten blocks were dropped: a rerun is still correct.
    outputs = run_to_completion_with(engine, list(range(1, 21)))
    assert tokens_of(outputs) == naive_greedy(model, list(range(1, 21)), 12)


def run_to_completion_with(engine: Engine, prompt: list[int]) -> list[RequestOutput]:
    request_id = engine.add_request(prompt, GREEDY)
    return run_to_completion(engine)[request_id]


def test_abort_while_decoding_frees_every_block(model: GPT2LMHeadModel) -> None:
    engine = make_engine(model)
    request_id = engine.add_request([3, 1, 4, 1, 5, 9, 2, 6], GREEDY)
    for _ in range(3):
        engine.step()
    assert engine.num_running == 1
    assert engine.abort(request_id)
    assert not engine.abort(request_id)
    assert_no_leak(engine)
    assert engine.step() == []


def test_unknown_request_abort_returns_false(model: GPT2LMHeadModel) -> None:
    engine = make_engine(model)
    assert not engine.abort(0)
    request_id = engine.add_request([1], SamplingParams(max_tokens=1, temperature=0))
    run_to_completion(engine)
    assert not engine.abort(request_id)
    assert_no_leak(engine)


@pytest.mark.timeout(300)  # 1,000 operations, each step a real forward pass
def test_random_add_abort_step_operations_leak_no_block(model: GPT2LMHeadModel) -> None:
    rng = random.Random(7)
    engine = make_engine(
        model,
        num_blocks=16,
        max_num_seqs=4,
        max_num_batched_tokens=8,
        max_waiting=6,
        max_model_len=48,
    )
    known: list[int] = []
    num_refused = 0
    for _ in range(1000):
        op = rng.random()
        if op < 0.4:
            prompt = [rng.randrange(4) for _ in range(rng.randint(1, 20))]
            params = SamplingParams(max_tokens=rng.randint(1, 12), temperature=0)
            try:
                known.append(engine.add_request(prompt, params))
            except QueueFullError:
                num_refused += 1
        elif op < 0.6 and known:
            engine.abort(rng.choice(known))
        else:
            engine.step()
        stats = engine.block_manager_stats()
        assert stats.num_free_blocks + stats.num_used_blocks == stats.num_blocks
    assert num_refused > 0
    assert engine.num_requests > 0
    for request_id in known:
        engine.abort(request_id)
    assert_no_leak(engine)


def test_max_tokens_finishes_with_length(model: GPT2LMHeadModel) -> None:
    outputs = generate_alone(model, [4, 5, 6], SamplingParams(max_tokens=5, temperature=0))
    assert len(tokens_of(outputs)) == 5
    assert (outputs[-1].finished, outputs[-1].finish_reason) == (True, "length")
    assert outputs[-1].num_completion_tokens == 5
    assert text_of(outputs) == "".join(ascii_bytes(t).decode() for t in tokens_of(outputs))


def first_new_token_index(tokens: list[int]) -> int:
    """An index whose token does not occur before it, past the first few."""
    for index in range(2, len(tokens)):
        if tokens[index] not in tokens[:index]:
            return index
    raise AssertionError("no fresh token in the reference")


def test_stop_token_id_finishes_with_stop_and_hides_its_text(model: GPT2LMHeadModel) -> None:
    prompt = [8, 6, 7, 5, 3, 0, 9]
    reference = naive_greedy(model, prompt, 16)
    index = first_new_token_index(reference)
    params = SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[reference[index]])
    outputs = generate_alone(model, prompt, params)
    assert tokens_of(outputs) == reference[: index + 1]
    assert (outputs[-1].finished, outputs[-1].finish_reason) == (True, "stop")
    assert text_of(outputs) == "".join(ascii_bytes(t).decode() for t in reference[:index])


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_eos_finishes_with_stop_unless_ignored(model: GPT2LMHeadModel, ignore_eos: bool) -> None:
    prompt = [8, 6, 7, 5, 3, 0, 9]
    reference = naive_greedy(model, prompt, 16)
    index = first_new_token_index(reference)
    engine = make_engine(model, eos_token_id=reference[index])
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=ignore_eos)
    request_id = engine.add_request(prompt, params)
    outputs = run_to_completion(engine)[request_id]
    if ignore_eos:
        assert tokens_of(outputs) == reference
        assert outputs[-1].finish_reason == "length"
    else:
        assert tokens_of(outputs) == reference[: index + 1]
        assert outputs[-1].finish_reason == "stop"


def test_any_of_several_eos_ids_finishes_with_stop(model: GPT2LMHeadModel) -> None:
    """A model with two end tokens (Llama 3's ``<|end_of_text|>`` and ``<|eot_id|>``): the
    second one, not the first, ends this generation."""
    prompt = [8, 6, 7, 5, 3, 0, 9]
    reference = naive_greedy(model, prompt, 16)
    index = first_new_token_index(reference)
    never = next(t for t in range(model.config.vocab_size) if t not in reference)
    engine = make_engine(model, eos_token_id=[never, reference[index]])
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=16, temperature=0))
    outputs = run_to_completion(engine)[request_id]
    assert tokens_of(outputs) == reference[: index + 1]
    assert outputs[-1].finish_reason == "stop"


def test_stop_string_split_across_tokens_is_caught_and_not_leaked(
    model: GPT2LMHeadModel,
) -> None:
    prompt = [2, 7, 1, 8, 2, 8]
    reference = naive_greedy(model, prompt, 16)

    def token_text(token: int) -> str:
        return f"{token:03d}|"

    index = 5  # the stop string spans the end of token 5 and the start of token 6
    stop = token_text(reference[index])[2:] + token_text(reference[index + 1])[:2]
    full = "".join(token_text(t) for t in reference)
    cut = full.find(stop)
    num_expected_tokens = next(
        n for n in range(1, 17) if stop in "".join(token_text(t) for t in reference[:n])
    )
    engine = make_engine(model, token_bytes=lambda t: token_text(t).encode())
    params = SamplingParams(max_tokens=16, temperature=0, stop=[stop])
    request_id = engine.add_request(prompt, params)
    outputs = run_to_completion(engine)[request_id]
    assert tokens_of(outputs) == reference[:num_expected_tokens]
    assert (outputs[-1].finished, outputs[-1].finish_reason) == (True, "stop")
    assert text_of(outputs) == full[:cut]
    assert all(stop not in output.new_text for output in outputs)


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(model: GPT2LMHeadModel) -> None:
    prompt = [10, 20, 30, 40, 50]
    params = SamplingParams(max_tokens=16, temperature=0.9, top_k=40, seed=1234, logprobs=True)
    alone = generate_alone(model, prompt, params)
    engine = make_engine(model, num_blocks=20, max_num_batched_tokens=12)
    rng = random.Random(3)
    for _ in range(5):
        other = [rng.randrange(101) for _ in range(rng.randint(1, 12))]
        engine.add_request(
            other, SamplingParams(max_tokens=10, temperature=1.0, seed=rng.randrange(99))
        )
    request_id = engine.add_request(prompt, params)
    engine.add_request(prompt[:4], SamplingParams(max_tokens=10, temperature=1.0))
    together = run_to_completion(engine)[request_id]
    assert tokens_of(together) == tokens_of(alone)
    assert all(output.logprobs is not None and len(output.logprobs) == 1 for output in together)
    assert_no_leak(engine)


def test_add_request_refuses_what_cannot_run(model: GPT2LMHeadModel) -> None:
    engine = make_engine(model, max_waiting=2, max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request([1] * 10, SamplingParams(max_tokens=7))
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request([1, 101], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="at least one"):
        engine.add_request([], SamplingParams(max_tokens=2))
    first = engine.add_request([1], SamplingParams(max_tokens=2))
    engine.add_request([1], SamplingParams(max_tokens=2))
    with pytest.raises(QueueFullError):
        engine.add_request([1], SamplingParams(max_tokens=2))
    assert engine.num_waiting == 2
    assert first == 0


def test_engine_config_refuses_a_model_len_beyond_the_cache_or_the_model(
    model: GPT2LMHeadModel,
) -> None:
    with pytest.raises(ValueError, match="KV cache"):
        EngineConfig(4, 4, 1, 8, 1, max_model_len=17)
    with pytest.raises(ValueError, match="n_positions"):
        make_engine(model, num_blocks=100, max_model_len=300)


def test_prefix_cache_hits_are_reported_in_outputs(model: GPT2LMHeadModel) -> None:
    engine = make_engine(model)
    prompt = list(range(1, 14))
    first = run_to_completion_with(engine, prompt)
    second = run_to_completion_with(engine, prompt)
    assert first[0].num_cached_tokens == 0
    assert second[0].num_cached_tokens == 12
    assert tokens_of(first) == tokens_of(second)
