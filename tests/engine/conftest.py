"""Fixtures of the engine tests."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["native-attention", "torch-attention"])
def attention_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test runs twice: with the C kernels (the default on a float32 CPU cache:
    attention, and a GPT-2 draft's greedy rounds) and with the torch path alone
    (``SLUICE_NATIVE_KERNELS=0``)."""
    if request.param == "torch-attention":
        monkeypatch.setenv("SLUICE_NATIVE_KERNELS", "0")
    return str(request.param)
