"""Fixtures of the engine tests."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["native-attention", "torch-attention"])
def attention_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each paged model test runs twice: attention by the C kernel (the default on a
    float32 CPU cache) and by the torch path (``SLUICE_NATIVE_ATTENTION=0``)."""
    if request.param == "torch-attention":
        monkeypatch.setenv("SLUICE_NATIVE_ATTENTION", "0")
    return str(request.param)
