"""Shared fixtures: a real server process on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.server import ServerProcess


@pytest.fixture(scope="session")
def server() -> Iterator[ServerProcess]:
    """One ``sluice serve`` for the session, with short heartbeats and grace windows."""
    with ServerProcess("--heartbeat-interval", "0.3", "--grace", "2", "--retry", "200") as proc:
        yield proc
