"""SamplingParams: validated once, immutable."""

from __future__ import annotations

from typing import Any

import pytest

from sluice.engine.sampling_params import SamplingParams


def test_defaults_are_valid_and_sequences_are_frozen() -> None:
    params = SamplingParams(stop=["a", "b"], stop_token_ids=[50256])
    assert params.stop == ("a", "b")
    assert params.stop_token_ids == (50256,)
    assert not params.greedy
    assert SamplingParams(temperature=0).greedy
    assert hash(params) == hash(SamplingParams(stop=("a", "b"), stop_token_ids=(50256,)))


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 1e9}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": -1}, "seed"),
        ({"stop": [""]}, "stop strings"),
        ({"stop": ["x"] * 17}, "at most 16"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
    ],
)
def test_absurd_values_are_refused_with_the_field_named(
    kwargs: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(ValueError, match=fragment):
        SamplingParams(**kwargs)
