"""A real ``sluice serve`` process on 127.0.0.1 for tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

import httpx

__all__ = ["ServerProcess", "free_port"]

_STARTUP_DEADLINE_S = 20.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class ServerProcess:
    """``sluice serve`` with the given options; ``base_url`` once started."""

    def __init__(self, *options: str) -> None:
        self.port = free_port()
        self.options: Sequence[str] = options
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> ServerProcess:
        command = [
            sys.executable,
            "-m",
            "sluice.cli",
            "serve",
            "--port",
            str(self.port),
            "--log-level",
            "warning",
            *self.options,
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(command, env=env)
        deadline = time.monotonic() + _STARTUP_DEADLINE_S
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"sluice serve exited with {self.process.returncode}")
            try:
                if httpx.get(f"{self.base_url}/healthz", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("sluice serve did not become healthy in time")
            time.sleep(0.05)  # polling the port while the process starts; not synchronisation

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)
        self.process = None

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
