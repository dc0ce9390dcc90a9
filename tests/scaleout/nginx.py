"""Debian's ``nginx`` as a round-robin load balancer in front of gateways, on 127.0.0.1.

No stickiness and nginx's default buffering (``proxy_buffering on``: Sluice's SSE answers
say ``X-Accel-Buffering: no`` themselves). A connection nginx cannot open to one gateway
(a killed one) is tried on the next (``proxy_next_upstream error``, its default); a
gateway is never marked down (``max_fails=0``), so killing one tests the clients, not
nginx's health checks.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path

import httpx

from tests.scaleout.replicas import wait_until

__all__ = ["Nginx"]

_CONFIG = """\
daemon off;
master_process on;
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    upstream gateways {{
{servers}
        keepalive 64;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://gateways;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host $http_host;
            proxy_read_timeout 60s;
            proxy_next_upstream error timeout;
        }}
    }}
}}
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


class Nginx:
    """nginx balancing over ``ports``, configured and run in ``directory``."""

    def __init__(self, directory: Path, ports: Sequence[int]) -> None:
        executable = shutil.which("nginx") or "/usr/sbin/nginx"
        if not Path(executable).exists():
            raise RuntimeError("nginx is missing: run scripts/setup.sh --test")
        self.executable = executable
        self.directory = directory
        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        servers = "\n".join(f"        server 127.0.0.1:{p} max_fails=0;" for p in ports)
        self.config = directory / "nginx.conf"
        self.config.write_text(_CONFIG.format(dir=directory, servers=servers, port=self.port))
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Nginx:
        self.process = subprocess.Popen(
            [self.executable, "-c", str(self.config), "-p", str(self.directory)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_until(self._answers, "nginx answers")
        return self

    def _answers(self) -> bool:
        try:
            return httpx.get(f"{self.base_url}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def __exit__(self, *exc_info: object) -> None:
        process, self.process = self.process, None
        if process is not None:
            process.terminate()
            process.wait(timeout=10)
