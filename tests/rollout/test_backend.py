"""An alias's backend: each stream on one version, reported once as it ended."""

from __future__ import annotations

import asyncio
import tomllib

import pytest

from sluice.backends.base import GenerationRequest, Tool, model_version
from sluice.backends.words import WordsBackend
from sluice.errors import BackendError, BadRequestError, ConfigError
from sluice.rollout.analysis import Outcome
from sluice.rollout.backend import RoutedGeneration, alias_backends
from sluice.rollout.config import parse_models_config
from sluice.rollout.controller import Rollouts

CONFIG = """
[[alias]]
name = "assistant"
rollout = "manual"
[[alias.version]]
name = "v1"
model = "{stable_model}"
weight = 50
stable = true
[[alias.version]]
name = "v2"
model = "words"
weight = 50
fault_error_rate = 1
"""


def routed(
    request: GenerationRequest, *, fail: bool = False
) -> tuple[RoutedGeneration, list[Outcome]]:
    outcomes: list[Outcome] = []
    inner = WordsBackend(fault_error_rate=1.0 if fail else 0.0).generate(request)
    return RoutedGeneration(inner, "v1", canary=True, report=outcomes.append), outcomes


async def drain(generation: RoutedGeneration) -> None:
    await generation.start()
    async for _ in generation:
        pass


def test_finished_stream_is_reported_once_with_its_latencies() -> None:
    generation, outcomes = routed(GenerationRequest(prompt="a b c", interval_s=0.001))
    asyncio.run(drain(generation))
    asyncio.run(generation.abort())  # after the end: not a cancellation
    (outcome,) = outcomes
    assert (outcome.canary, outcome.failed, outcome.cancelled) == (True, False, False)
    assert outcome.ttft_s is not None
    assert outcome.itl_s is not None
    assert model_version(generation) == "v1"


def test_failed_and_cancelled_streams_are_reported_as_such() -> None:
    failing, failures = routed(GenerationRequest(prompt="a b"), fail=True)
    with pytest.raises(BackendError):
        asyncio.run(drain(failing))
    asyncio.run(failing.abort())  # the hub aborts after a failure: still one outcome
    assert [(o.failed, o.cancelled, o.ttft_s) for o in failures] == [(True, False, None)]

    async def cancel_midway() -> list[Outcome]:
        generation, outcomes = routed(GenerationRequest(prompt="a b c d", interval_s=0.001))
        await generation.start()
        async for _ in generation:
            break
        await generation.abort()
        return outcomes

    (cancelled,) = asyncio.run(cancel_midway())
    assert (cancelled.failed, cancelled.cancelled) == (False, True)


def test_a_request_refused_at_start_is_not_an_outcome_of_the_version() -> None:
    generation, outcomes = routed(GenerationRequest(prompt="a", tools=(Tool("f"),)))
    with pytest.raises(BadRequestError):
        asyncio.run(generation.start())
    asyncio.run(generation.abort())
    assert outcomes == []


def test_aliases_are_built_over_served_models_and_words() -> None:
    config = parse_models_config(tomllib.loads(CONFIG.format(stable_model="words")))
    rollouts = Rollouts(config)
    (backend,) = alias_backends(config, {}, rollouts).values()
    assert backend.model == "assistant"
    request = GenerationRequest(prompt="x", routing_key="someone")
    first = backend.generate(request)
    assert model_version(first) in {"v1", "v2"}
    assert {model_version(backend.generate(request)) for _ in range(10)} == {model_version(first)}


def test_alias_of_an_unserved_model_or_named_like_a_served_one_is_refused() -> None:
    config = parse_models_config(tomllib.loads(CONFIG.format(stable_model="big")))
    with pytest.raises(ConfigError, match="model 'big' is not served; served: small, words"):
        alias_backends(config, {"small": WordsBackend("small")}, Rollouts(config))
    clash = parse_models_config(tomllib.loads(CONFIG.format(stable_model="words")))
    with pytest.raises(ConfigError, match="'assistant' has the name of a served model"):
        alias_backends(clash, {"assistant": WordsBackend("assistant")}, Rollouts(clash))
