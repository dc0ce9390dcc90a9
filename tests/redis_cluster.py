"""A real three-node Redis Cluster (Debian's ``redis-server`` and ``redis-cli``) on 127.0.0.1.

Each node is a :class:`~tests.redis_server.RedisServer` with ``--cluster-enabled yes`` in
a directory of its own, on a free port; ``redis-cli --cluster create`` gives each a third
of the slots (no replicas), and the cluster is ready once every node reports
``cluster_state:ok`` (polled with a deadline: the nodes agree over their cluster bus, and
nothing logs when they have).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from pathlib import Path

import redis
from redis.cluster import RedisCluster as SyncRedisCluster

from tests.redis_server import RedisServer, free_port
from tests.scaleout.replicas import wait_until

__all__ = ["RedisClusterServers"]

NUM_NODES = 3
# A node's cluster bus listens on its port plus this.
_BUS_PORT_OFFSET = 10_000


def _free_node_port() -> int:
    """A free port whose cluster bus port (10,000 above it) is free too."""
    while True:
        port = free_port()
        if port + _BUS_PORT_OFFSET > 65_535:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port + _BUS_PORT_OFFSET))
            except OSError:
                continue
        return port


def _cluster_ok(port: int) -> bool:
    with redis.Redis(port=port) as client:
        info = client.execute_command("CLUSTER", "INFO")
    text = info.decode() if isinstance(info, bytes) else str(info)
    return "cluster_state:ok" in text


class RedisClusterServers:
    """Three ``redis-server`` cluster nodes under ``directory``, joined as one cluster."""

    def __init__(self, directory: Path) -> None:
        self.nodes = []
        for i in range(NUM_NODES):
            node_dir = directory / f"node{i}"
            node_dir.mkdir(parents=True, exist_ok=True)
            options = (
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(node_dir / "nodes.conf"),
                "--cluster-node-timeout", "5000",
            )  # fmt: skip
            self.nodes.append(RedisServer(node_dir, options=options, port=_free_node_port()))
        self.url = f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> RedisClusterServers:
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError("redis-cli is missing: run scripts/setup.sh --test")
        try:
            for node in self.nodes:
                node.start()
            addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
            create = [cli, "--cluster", "create", *addresses, "--cluster-replicas", "0"]
            subprocess.run([*create, "--cluster-yes"], check=True, capture_output=True, timeout=60)
            for node in self.nodes:
                wait_until(lambda port=node.port: _cluster_ok(port), "cluster_state:ok", 30.0)
        except BaseException:
            self.stop()
            raise
        return self

    def client(self) -> SyncRedisCluster:
        return SyncRedisCluster(host="127.0.0.1", port=self.nodes[0].port)

    def flush(self) -> None:
        """Empty every node (a cluster has one database: tests share it in turn)."""
        for node in self.nodes:
            with redis.Redis(port=node.port) as client:
                client.flushall()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> RedisClusterServers:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
