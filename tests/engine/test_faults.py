"""Faults stay with the request that caused them.

A request whose own row fails (NaN logits from the model, a token its detokenizer cannot
take) is aborted alone in that step, with every block freed and one finished output that
carries a message for its client; every other request of the batch gets exactly the tokens
it would have had alone. Blocks that held a failed request's NaN KV are reused without
harm. Only a failing forward pass aborts the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from sluice.engine.engine import REQUEST_FAILED_MESSAGE, Engine, EngineConfig, RequestOutput
from sluice.engine.models import GPT2Config, GPT2LMHeadModel
from sluice.engine.sampling_params import SamplingParams
from tests.engine.test_engine import assert_no_leak, naive_greedy, run_to_completion, tokens_of
from tests.engine.tiny_models import ascii_bytes, nan_at_position, varied_gpt2

MODEL_CONFIG = GPT2Config(vocab_size=101, n_positions=64, n_embd=64, n_layer=2, n_head=4)
BLOCK_SIZE = 4
NAN_POSITION = 24  # sequences reaching this position get NaN logits
GREEDY = SamplingParams(max_tokens=12, temperature=0)
SAMPLED = SamplingParams(max_tokens=12, temperature=1.0, seed=5)
LIVE_PROMPTS = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]]


def make_engine(
    model: GPT2LMHeadModel,
    *,
    num_blocks: int = 16,
    token_bytes: Callable[[int], bytes] = ascii_bytes,
) -> Engine:
    config = EngineConfig(
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_waiting=16,
        max_model_len=64,
    )
    return Engine(model, config, eos_token_id=None, token_bytes=token_bytes)


@pytest.fixture(scope="module")
def nan_model() -> GPT2LMHeadModel:
    return nan_at_position(MODEL_CONFIG, NAN_POSITION)


def assert_failed_alone(outputs: list[RequestOutput], message: str) -> None:
    assert outputs[-1].finished
    assert outputs[-1].finish_reason is None
    assert outputs[-1].error == message
    assert outputs[-1].new_token_ids == ()
    assert all(output.error is None for output in outputs[:-1])


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_request_with_nan_logits_fails_alone_and_frees_its_blocks(
    nan_model: GPT2LMHeadModel, params: SamplingParams
) -> None:
    engine = make_engine(nan_model, num_blocks=32)
    live = [engine.add_request(prompt, GREEDY) for prompt in LIVE_PROMPTS]
    first_step = engine.step()  # the live requests prefill, then decode beside the poisoned
    poisoned = engine.add_request(list(range(1, NAN_POSITION + 3)), params)
    outputs = run_to_completion(engine)
    for output in first_step:
        outputs[output.request_id].insert(0, output)
    assert_failed_alone(outputs[poisoned], "the model produced non-finite logits for this request")
    assert len(outputs[poisoned]) == 1
    for request_id, prompt in zip(live, LIVE_PROMPTS, strict=True):
        assert outputs[request_id][-1].finish_reason == "length"
        assert tokens_of(outputs[request_id]) == naive_greedy(nan_model, prompt, 12)
    assert_no_leak(engine)


def test_blocks_that_held_nan_kv_are_reused_without_harm(nan_model: GPT2LMHeadModel) -> None:
    """The poisoned prompt fills 7 of 18 blocks with NaN K/V. Four requests of different
    lengths that need all 18 blocks then decode side by side: the shorter ones' masked
    slots (their last block's unwritten ones, and block 0 as table padding) hold that
    stale NaN, and it must not reach their attention."""
    engine = make_engine(nan_model, num_blocks=18)
    poisoned = engine.add_request(list(range(1, NAN_POSITION + 3)), GREEDY)
    assert run_to_completion(engine)[poisoned][-1].error is not None
    assert_no_leak(engine)
    prompts = [[1], [2, 3], [4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]  # 4, 4, 5 and 5 blocks
    live = [engine.add_request(prompt, GREEDY) for prompt in prompts]
    outputs = run_to_completion(engine)
    for request_id, prompt in zip(live, prompts, strict=True):
        assert tokens_of(outputs[request_id]) == naive_greedy(nan_model, prompt, 12)
    assert_no_leak(engine)


def test_a_request_whose_token_cannot_be_detokenized_fails_alone() -> None:
    """A bug in one request's postprocess (here its token's bytes raise) fails that request
    with a generic message; the traceback is the server log's, not the client's."""
    model = varied_gpt2(MODEL_CONFIG)
    expected = [naive_greedy(model, prompt, 12) for prompt in LIVE_PROMPTS]
    # The first request with a token that no other request generates: it fails on it.
    victim, bad_token = next(
        (i, token)
        for i, tokens in enumerate(expected)
        for token in tokens
        if all(token not in other for j, other in enumerate(expected) if j != i)
    )

    def token_bytes(token: int) -> bytes:
        if token == bad_token:
            raise RuntimeError("internal detail that must not reach a client")
        return ascii_bytes(token)

    engine = make_engine(model, token_bytes=token_bytes)
    ids = [engine.add_request(prompt, GREEDY) for prompt in LIVE_PROMPTS]
    outputs = run_to_completion(engine)
    failed = outputs[ids[victim]]
    assert_failed_alone(failed, REQUEST_FAILED_MESSAGE)
    assert tokens_of(failed) == expected[victim][: expected[victim].index(bad_token)]
    for i, request_id in enumerate(ids):
        if i != victim:
            assert outputs[request_id][-1].finish_reason == "length"
            assert tokens_of(outputs[request_id]) == expected[i]
    assert_no_leak(engine)


def test_a_failing_forward_pass_aborts_its_batch_and_leaves_the_engine_usable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = varied_gpt2(MODEL_CONFIG)
    engine = make_engine(model)
    first = engine.add_request([1, 2, 3], GREEDY)
    engine.step()
    real_run = engine.model_runner.run

    def failing_run(*args: object, **kwargs: object) -> object:
        monkeypatch.setattr(engine.model_runner, "run", real_run)
        raise RuntimeError("the model broke")

    monkeypatch.setattr(engine.model_runner, "run", failing_run)
    with pytest.raises(RuntimeError, match="the model broke"):
        engine.step()
    assert not engine.abort(first)
    assert_no_leak(engine)
    again = engine.add_request([1, 2, 3], GREEDY)
    assert tokens_of(run_to_completion(engine)[again]) == naive_greedy(model, [1, 2, 3], 12)
