"""``sluice serve`` with hub and SSE limits set from the environment (tests only).

Until ``sluice serve`` has flags for them, the tests of admission and slow clients run the
real command (same parser, uvicorn config and protocol) with one change: the app's
:class:`~sluice.streams.hub.HubSettings` and :class:`~sluice.transports.sse.SSEOptions` are
replaced by ones with the fields of the JSON objects in ``SLUICE_TEST_HUB`` and
``SLUICE_TEST_SSE``. Run: ``python -m tests.gateway.limited_server [serve options]``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import sluice.cli
from sluice.gateway.app import SluiceApp, create_app
from tests.server import ServerProcess

__all__ = ["LimitedServer"]


def _create_limited_app(*args: Any, **kwargs: Any) -> SluiceApp:
    app = create_app(*args, **kwargs)
    hub_fields = json.loads(os.environ.get("SLUICE_TEST_HUB", "{}"))
    sse_fields = json.loads(os.environ.get("SLUICE_TEST_SSE", "{}"))
    app.hub.settings = dataclasses.replace(app.hub.settings, **hub_fields)
    app.streams.options = dataclasses.replace(app.streams.options, **sse_fields)
    return app


class LimitedServer(ServerProcess):
    """:class:`~tests.server.ServerProcess` running this launcher with the given limits."""

    def __init__(
        self,
        *options: str,
        hub: Mapping[str, object] = {},
        sse: Mapping[str, object] = {},
        send_buffer_bytes: int | None = None,
    ) -> None:
        super().__init__(*options)
        if send_buffer_bytes is not None:
            # Accepted sockets inherit it (and lose send-buffer autotuning, which on
            # loopback grows to megabytes): a stuck client then backs up the server soon.
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
        self.limits = {"SLUICE_TEST_HUB": json.dumps(hub), "SLUICE_TEST_SSE": json.dumps(sse)}

    def start(self) -> LimitedServer:
        fd = self.sock.fileno()
        command = [
            sys.executable,
            "-m",
            "tests.gateway.limited_server",
            "--fd",
            str(fd),
            "--port",
            str(self.port),
            "--log-level",
            "warning",
            *self.options,
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.limits}
        self.process = subprocess.Popen(command, env=env, pass_fds=(fd,))
        return self

    def rss_bytes(self) -> int:
        """The server's resident memory now (from /proc)."""
        assert self.process is not None
        with open(f"/proc/{self.process.pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")


def main(argv: Sequence[str] | None = None) -> int:
    sluice.cli.create_app = _create_limited_app  # type: ignore[assignment]
    return sluice.cli.main(["serve", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
