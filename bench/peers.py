"""Server processes for the SSE benchmark: ours and the sse-starlette baseline.

Each server is one child process on 127.0.0.1 and a free port, with its output in a log
file. ``ServerProcess`` starts it, waits (bounded) until it answers HTTP, and always stops
it: SIGTERM, then SIGKILL after a bounded wait. Children inherit this process's
RLIMIT_NOFILE, so raise it (``ssebench.raise_nofile()``) before starting any.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Final

__all__ = [
    "BENCH_DIR",
    "ServerProcess",
    "baseline_command",
    "engine_baseline_command",
    "engine_command",
    "free_port",
    "ours_command",
    "process_cpu_s",
    "scan_log",
    "tick_command",
]

BENCH_DIR = Path(__file__).resolve().parent
HOST = "127.0.0.1"
# uvicorn options of the ssebench peers (its README, "Starting a peer by hand").
_UVICORN_OPTIONS = (
    "--loop uvloop --http httptools --workers 1 --backlog 4096 --no-access-log --log-level warning"
)
# Our servers are stopped with SIGTERM once their measurement is done, often with streams
# still live (a concurrency ramp's readers are gone, their streams wait out the grace
# window): give those streams 2 s to finish instead of the 30 s drain a deployment gets, so
# that every server ends (2 s, then up to --shutdown-timeout's 5 s) within the 20 s that
# ServerProcess.stop waits.
_STOP_OPTIONS = ("--drain-timeout", "2")
# Lines in a server's log that mean it misbehaved.
_TROUBLE = re.compile(r"Traceback|Exception|Error|ERROR|CRITICAL|WARNING|Killed|exceeded")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def ours_command(port: int, *options: str) -> list[str]:
    """``sluice serve`` as a user runs it (with a short drain, see ``_STOP_OPTIONS``)."""
    return [
        sys.executable,
        "-m",
        "sluice.cli",
        "serve",
        "--host",
        HOST,
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--no-model",  # the words path is what these tests measure
        *_STOP_OPTIONS,
        *options,
    ]


def tick_command(port: int, *options: str) -> list[str]:
    """``sluice serve`` with the timestamping backend (see ``tick_server.py``)."""
    return [
        sys.executable,
        str(BENCH_DIR / "tick_server.py"),
        "--host",
        HOST,
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--no-model",
        *_STOP_OPTIONS,
        *options,
    ]


def engine_command(port: int, *options: str) -> list[str]:
    """``sluice serve`` with the one-timer engine-shaped backend (see ``engine_server.py``)."""
    return [
        sys.executable,
        str(BENCH_DIR / "engine_server.py"),
        "--host",
        HOST,
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--no-model",
        *_STOP_OPTIONS,
        *options,
    ]


def engine_baseline_command(port: int) -> list[str]:
    """The sse-starlette baseline of the engine test (``engine_peer.py``), with the
    ssebench peers' uvicorn flags."""
    return [
        sys.executable,
        "-m",
        "uvicorn",
        "--app-dir",
        str(BENCH_DIR),
        "engine_peer:app",
        "--host",
        HOST,
        "--port",
        str(port),
        *_UVICORN_OPTIONS.split(),
    ]


def baseline_command(ssebench_dir: Path, port: int) -> list[str]:
    """The ssebench sse-starlette peer with the runner's uvicorn flags."""
    return [
        sys.executable,
        "-m",
        "uvicorn",
        "--app-dir",
        str(ssebench_dir / "peers"),
        "asgi_apps:sse_app",
        "--host",
        HOST,
        "--port",
        str(port),
        *_UVICORN_OPTIONS.split(),
    ]


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (from the ppid field of /proc/*/stat)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_bytes()
            ppid = int(stat[stat.rfind(b")") + 2 :].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, ()))
    return found


def process_cpu_s(pid: int) -> float:
    """CPU seconds used so far by ``pid`` and its descendants, every thread.

    Live threads count at nanosecond resolution (the first field of
    /proc/PID/task/TID/schedstat, the same source as ssebench's server CPU figures).
    Threads that have exited and reaped children are gone from there, so without them a
    process that starts and ends threads (LiteLLM does, per request) could even show
    negative CPU over an interval: they count at clock-tick resolution, as what the
    process's /proc/PID/stat totals hold beyond its live threads' own totals.
    """
    total_s = 0.0
    for process in _descendants(pid):
        try:
            threads = list(Path(f"/proc/{process}/task").iterdir())
            process_ticks = _stat_ticks(Path(f"/proc/{process}/stat"), children=True)
        except (OSError, IndexError, ValueError):
            continue
        live_ticks = 0
        for thread in threads:
            try:
                total_s += int((thread / "schedstat").read_text().split()[0]) / 1e9
                live_ticks += _stat_ticks(thread / "stat", children=False)
            except (OSError, IndexError, ValueError):
                continue
        total_s += max(0, process_ticks - live_ticks) / _CLOCK_TICKS
    return total_s


_CLOCK_TICKS: Final = os.sysconf("SC_CLK_TCK")


def _stat_ticks(path: Path, *, children: bool) -> int:
    """utime + stime (+ cutime + cstime) of a /proc stat file, in clock ticks."""
    stat = path.read_bytes()
    fields = stat[stat.rfind(b")") + 2 :].split()  # fields from the third (state) on
    ticks = int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15
    if children:
        ticks += int(fields[13]) + int(fields[14])  # cutime, cstime: reaped children
    return ticks


def _answers(port: int, path: str) -> bool:
    conn = http.client.HTTPConnection(HOST, port, timeout=1.0)
    try:
        conn.request("GET", path)
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def scan_log(path: Path, limit: int = 20) -> list[str]:
    """The lines of a server log that look like trouble (at most ``limit``)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [line for line in lines if _TROUBLE.search(line)][:limit]


class ServerProcess:
    """One server child process; use as a context manager."""

    def __init__(
        self,
        name: str,
        command: list[str],
        port: int,
        health_path: str,
        log_path: Path,
        env: dict[str, str] | None = None,
        *,
        ready_timeout_s: float = 60.0,
        cwd: Path = BENCH_DIR,
        unset_env: tuple[str, ...] = (),
        own_process_group: bool = False,
    ) -> None:
        self.name = name
        self.command = command
        self.port = port
        self.health_path = health_path
        self.log_path = log_path
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        for variable in unset_env:
            self.env.pop(variable, None)
        self.ready_timeout_s = ready_timeout_s
        self.cwd = cwd
        # A server that starts processes of its own (vLLM's engine core) runs in a process
        # group of its own, and stop() ends whatever of that group outlives the server.
        self.own_process_group = own_process_group
        self.process: subprocess.Popen[bytes] | None = None
        self.exit_note = ""

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self, ready_timeout: float | None = None) -> ServerProcess:
        ready_timeout = self.ready_timeout_s if ready_timeout is None else ready_timeout
        with self.log_path.open("ab") as log:
            log.write(f"$ {' '.join(self.command)}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                start_new_session=self.own_process_group,
            )
        deadline = time.monotonic() + ready_timeout
        while not _answers(self.port, self.health_path):
            if self.process.poll() is not None:
                returncode = self.process.returncode
                self.stop()  # its process group's leftovers, if it has one
                raise RuntimeError(f"{self.name} exited with {returncode}; see {self.log_path}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"{self.name} not ready in {ready_timeout} s; see {self.log_path}"
                )
            time.sleep(0.1)
        return self

    def nofile_limit(self) -> str:
        """The server's own soft RLIMIT_NOFILE, from /proc."""
        try:
            for line in Path(f"/proc/{self.pid}/limits").read_text().splitlines():
                if line.startswith("Max open files"):
                    return line.split()[3]
        except OSError:
            pass
        return "?"

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` s; records how it ended. With
        ``own_process_group``, what is left of the server's group is then killed."""
        process, self.process = self.process, None
        if process is None:
            return
        try:
            self._stop(process, timeout)
        finally:
            if self.own_process_group:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)

    def _stop(self, process: subprocess.Popen[bytes], timeout: float) -> None:
        if process.poll() is not None:
            self.exit_note = f"had exited by itself with {process.returncode}"
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)
            self.exit_note = f"did not stop within {timeout} s of SIGTERM: killed"
            return
        if process.returncode not in (0, -signal.SIGTERM):
            self.exit_note = f"exited with {process.returncode} after SIGTERM"

    def __enter__(self) -> ServerProcess:
        return self if self.process is not None else self.start()  # started: just hold it

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class WorkerChild:
    """``sluice worker`` of ``model`` on a free port, its output in a log file (a gateway in
    front of it waits, bounded, for it to answer)."""

    def __init__(self, model: Path, log_path: Path) -> None:
        self.model = model
        self.port = free_port()
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> WorkerChild:
        command = [sys.executable, "-m", "sluice.cli", "worker", "--model", str(self.model)]
        command += ["--listen", f"{HOST}:{self.port}", "--log-level", "warning"]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
