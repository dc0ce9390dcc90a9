"""Shared fixtures: a real server process on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.redis_cluster import RedisClusterServers
from tests.redis_server import RedisServer
from tests.server import ServerProcess

# In-process engines run on one torch thread, as `sluice serve` does on this 2-core VM
# (--engine-threads): the test process shares the cores with the servers it starts.
torch.set_num_threads(1)


@pytest.fixture(scope="session", params=["native-sse", "asgi-sse"])
def server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    """``sluice serve`` with short heartbeats and grace windows, once per SSE delivery path.

    ``native-sse`` is the default (callback-driven protocol); ``asgi-sse`` serves the same
    endpoints through the plain ASGI app, as any ASGI server would.
    """
    options = ["--heartbeat-interval", "0.3", "--grace", "2", "--retry", "200"]
    if request.param == "asgi-sse":
        options.append("--no-native-sse")
    with ServerProcess(*options) as proc:
        yield proc.wait_ready()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One real ``redis-server`` on a free loopback port for the session (each test that
    shares it uses streams of fresh ids, or a database of its own)."""
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterServers]:
    """A real three-node Redis Cluster on free loopback ports for the session (each test
    that uses it flushes it first)."""
    with RedisClusterServers(tmp_path_factory.mktemp("redis-cluster")) as cluster:
        yield cluster
