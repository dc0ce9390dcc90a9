"""A real ``sluice serve`` process on 127.0.0.1 for tests.

The test binds and listens on the socket itself and hands it to the server (``--fd``), so
the port is reachable before the server has even started: connections wait in the listen
backlog until it accepts them, and no test polls for readiness.

The server's engine serves the bundled ``sluice-tiny`` (fast to load and to run) unless the
options name a model (``--model``), serve none (``--no-model``) or configure upstreams
(``--upstream*``), or the test asks for ``sluice serve``'s own default model
(``default_model=True``: SmolLM2-135M-Instruct, see ``sluice.engine.default_model``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

__all__ = ["TEST_MODEL", "ServerProcess", "terminate", "wait_for_state"]

# The model of the fast tests (the repository's own).
TEST_MODEL = Path(__file__).resolve().parents[1] / "models" / "sluice-tiny"


def _names_a_model(options: tuple[str, ...]) -> bool:
    flags = {option.split("=", 1)[0] for option in options}
    return bool(flags & {"--model", "--no-model"}) or any(
        flag.startswith("--upstream") for flag in flags
    )


def terminate(process: subprocess.Popen[bytes], *, timeout_s: float) -> int:
    """SIGTERM, then SIGKILL if ``process`` is still there after ``timeout_s``; its exit
    code."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)
    return process.returncode


class ServerProcess:
    """``sluice serve`` with the given options, on a fresh loopback port."""

    def __init__(
        self,
        *options: str,
        send_buffer_bytes: int | None = None,
        log_level: str = "warning",
        stderr_path: Path | None = None,
        default_model: bool = False,
    ) -> None:
        if not default_model and not _names_a_model(options):
            options = ("--model", str(TEST_MODEL), *options)
        self.options = options
        self.log_level = log_level
        # Where the server's stderr (its log) goes; None: inherited from the tests.
        self.stderr_path = stderr_path
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if send_buffer_bytes is not None:
            # Accepted sockets inherit it (and lose send-buffer autotuning, which on
            # loopback grows to megabytes): a stuck client then backs up the server soon.
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1024)
        self.port: int = self.sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> ServerProcess:
        fd = self.sock.fileno()
        command = [
            sys.executable,
            "-m",
            "sluice.cli",
            "serve",
            "--fd",
            str(fd),
            "--port",
            str(self.port),
            "--log-level",
            self.log_level,
            *self.options,
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.stderr_path is None:
            self.process = subprocess.Popen(command, env=env, pass_fds=(fd,))
        else:
            with self.stderr_path.open("wb") as stderr:  # the child keeps its own copy
                self.process = subprocess.Popen(command, env=env, pass_fds=(fd,), stderr=stderr)
        return self

    def stop(self) -> int | None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s); return its exit code."""
        process, self.process = self.process, None
        return None if process is None else terminate(process, timeout_s=10)

    def rss_bytes(self) -> int:
        """The server's resident memory now (from /proc)."""
        assert self.process is not None
        with open(f"/proc/{self.process.pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def wait_ready(self, timeout_s: float = 120.0) -> ServerProcess:
        """Block on one ``GET /readyz``: it is answered once the server has started (loading
        the bundled model takes seconds on a busy machine; the request waits in the backlog)."""
        response = httpx.get(f"{self.base_url}/readyz", timeout=timeout_s)
        assert response.status_code == 200, response.text
        return self

    def close(self) -> None:
        self.stop()
        self.sock.close()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def wait_for_state(server: ServerProcess, stream_id: object, state: str) -> dict[str, object]:
    """Poll ``GET /v1/streams/{id}`` until the stream reaches ``state`` (10 s at most)."""
    deadline = time.monotonic() + 10
    described: dict[str, object] = {}
    while time.monotonic() < deadline:
        described = httpx.get(f"{server.base_url}/v1/streams/{stream_id}").json()
        if described["state"] == state:
            return described
        time.sleep(0.02)  # polling an observable condition with a deadline
    raise AssertionError(f"stream never reached {state!r}: {described}")
