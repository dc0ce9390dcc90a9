"""Fixtures of the engine tests."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["native", "torch"])
def kernel_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test runs twice: with the C kernels (the default on the CPU: attention over a
    float32 cache, a GPT-2 draft's rounds, sampling and the sampled verify) and with the
    torch path alone (``SLUICE_NATIVE_KERNELS=0``)."""
    if request.param == "torch":
        monkeypatch.setenv("SLUICE_NATIVE_KERNELS", "0")
    return str(request.param)
