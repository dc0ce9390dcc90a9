"""A real ``redis-server`` (Debian's, installed by ``scripts/setup.sh --test``) on 127.0.0.1.

It is started on a free port in the foreground, and the tests wait for the line it logs
once it accepts connections ("Ready to accept connections"), so nothing polls for
readiness. ``restart()`` stops it (``SHUTDOWN``, which saves its append-only file) and
starts it again on the same port, for the outage tests.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path

__all__ = ["RedisServer", "free_port"]

_READY = b"Ready to accept connections"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


class RedisServer:
    """``redis-server`` in ``directory``, with the append-only file on when asked."""

    def __init__(
        self,
        directory: Path,
        *,
        appendonly: bool = False,
        options: Sequence[str] = (),
        port: int | None = None,
    ) -> None:
        executable = shutil.which("redis-server")
        if executable is None:
            raise RuntimeError("redis-server is missing: run scripts/setup.sh --test")
        self.executable = executable
        self.directory = directory
        self.appendonly = appendonly
        self.options = tuple(options)  # more of redis-server's flags (a cluster node's)
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisServer:
        command = [
            self.executable,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.directory),
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--protected-mode",
            "no",
            "--loglevel",
            "notice",
            *self.options,
        ]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert self.process.stdout is not None
        seen = b""
        for line in self.process.stdout:
            seen += line
            if _READY in line:
                break
        else:
            raise RuntimeError(f"redis-server did not start:\n{seen.decode(errors='replace')}")
        # Keep draining its log so a chatty server never blocks on a full pipe.
        self._drain = subprocess.Popen(
            ["cat"], stdin=self.process.stdout, stdout=subprocess.DEVNULL
        )
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        process.send_signal(sig)
        process.wait(timeout=10)
        self._drain.wait(timeout=10)
        if process.stdout is not None:
            process.stdout.close()

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
