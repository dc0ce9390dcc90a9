"""The engine peers of ``bench/engine_throughput.py --peers``: where each is, and running one.

A peer is an engine in its own venv under ``.peers/`` (``scripts/install_peers.sh``), run
in its own process by its own Python through a runner script beside this file, on its own
copy of the bench's model (``PEER_MODELS``: the same weights, in the form that engine
loads). :func:`run_peer` hands it a :class:`~protocol.Job` and returns a
:class:`PeerOutcome`: the peer's result, or why there is none (not installed, no copy of
this model, the runner failed or ran out of time), so that a missing peer is a line in the
report, never a crash. Standard library only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from engine_peers.protocol import Job, PeerResult, ResultError, parse_result

__all__ = [
    "MODEL_KEYS",
    "NOT_INSTALLED",
    "PEERS",
    "PEERS_DIR",
    "Peer",
    "PeerOutcome",
    "busy_cores",
    "parse_peer_names",
    "peer_by_name",
    "run_peer",
    "wait_for_quiet",
]

REPO = Path(__file__).resolve().parents[2]
PEERS_DIR = REPO / ".peers"
RUNNER_DIR = Path(__file__).resolve().parent
NOT_INSTALLED = "not installed (run scripts/install_peers.sh)"
# The bench's models that the peers have copies of (install_peers.sh makes them).
MODEL_KEYS = ("sluice-tiny", "smollm2-135m")
MAX_LOG_TAIL_CHARS = 2_000  # of a failed runner's output, kept in its outcome
# Quiet enough to time an engine: the other jobs on the machine use under this many cores.
MAX_QUIET_BUSY_CORES = 0.25


@dataclass(frozen=True)
class Peer:
    name: str  # as --peers names it
    label: str  # as the report names it
    venv: str  # under PEERS_DIR
    runner: str  # beside this file (joined to RUNNER_DIR: an absolute path stays as it is)
    models: Mapping[str, str]  # model key -> the peer's copy, under PEERS_DIR

    def python(self, peers_dir: Path) -> Path:
        return peers_dir / self.venv / "bin" / "python"

    def env(self, threads: int) -> dict[str, str]:
        """The peer's environment: the bench's threads, offline, and its own settings."""
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
        env["TRANSFORMERS_OFFLINE"] = "1"
        if self.name == "vllm":
            # threads OpenMP threads bound to cores 0..threads-1 (vLLM's default reserves a
            # core for its scheduler: 1 thread on 2 cores); a 1 GiB KV cache holds 64 x 256.
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
            env["VLLM_CPU_KVCACHE_SPACE"] = "1"
        return env


PEERS = (
    Peer(
        name="vllm",
        label="vLLM CPU",
        venv="vllm",
        runner="vllm_runner.py",
        models={"sluice-tiny": "sluice-tiny-hf", "smollm2-135m": "smollm2-135m-hf"},
    ),
    Peer(
        name="llama.cpp",
        label="llama.cpp",
        venv="llama",
        runner="llama_cpp_runner.py",
        models={
            "sluice-tiny": "sluice-tiny-f32.gguf",
            "smollm2-135m": "smollm2-135m-f32.gguf",
        },
    ),
)


def parse_peer_names(text: str) -> list[str]:
    """``--peers``' comma-separated names; ValueError names the known ones."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    for name in names:
        peer_by_name(name)
    return names


def peer_by_name(name: str) -> Peer:
    for peer in PEERS:
        if peer.name == name:
            return peer
    known = ", ".join(p.name for p in PEERS)
    raise ValueError(f"unknown peer {name!r} (known: {known})")


@dataclass(frozen=True)
class PeerOutcome:
    """A peer's result, or the reason it has none."""

    peer: Peer
    result: PeerResult | None
    reason: str = ""

    def figures(self) -> dict[str, object]:
        """For the bench's --json: the result without its token ids, or why there is none."""
        if self.result is None:
            return {"missing": self.reason}
        figures = dataclasses.asdict(self.result)
        for phase in ("batch", "one_sequence"):
            del figures[phase]["completions"]
        return figures


def run_peer(
    peer: Peer,
    job: Job,
    model_key: str | None,
    *,
    timeout_s: float,
    peers_dir: Path = PEERS_DIR,
    log: Callable[[str], None] = lambda line: None,
) -> PeerOutcome:
    """``job`` on ``peer``'s copy of the model ``model_key`` names (``job.model`` is set
    here), in a child process bounded by ``timeout_s``; never raises for the peer's faults.
    ``log`` is told when it starts and how it ended (one line each)."""
    log(f"{peer.label}: running ...")
    outcome = _run_peer(peer, job, model_key, timeout_s, peers_dir)
    if outcome.result is None:
        log(f"{peer.label}: {outcome.reason.splitlines()[0]}")
    else:
        log(f"{peer.label}: {outcome.result.batch.tokens_per_s:.0f} tok/s all at once")
    return outcome


def _run_peer(
    peer: Peer, job: Job, model_key: str | None, timeout_s: float, peers_dir: Path
) -> PeerOutcome:
    python = peer.python(peers_dir)
    if not python.is_file():
        return PeerOutcome(peer, None, NOT_INSTALLED)
    if model_key is None or model_key not in peer.models:
        models = " and ".join(MODEL_KEYS)
        return PeerOutcome(peer, None, f"skipped: the peers run {models} only")
    model = peers_dir / peer.models[model_key]
    if not model.exists():
        return PeerOutcome(peer, None, f"{NOT_INSTALLED}: no {model.name}")
    job = dataclasses.replace(job, model=str(model))
    with tempfile.TemporaryDirectory(prefix=f"peer-{peer.venv}-") as tmp:
        job_path, result_path, log_path = (Path(tmp) / n for n in ("job", "result", "log"))
        job_path.write_text(job.to_json())
        command = [str(python), str(RUNNER_DIR / peer.runner), str(job_path), str(result_path)]
        with log_path.open("wb") as log:
            returncode = _run_bounded(command, peer.env(job.threads), log, timeout_s)
        tail = _tail(log_path)
        if returncode is None:
            return PeerOutcome(peer, None, f"failed: no result within {timeout_s:.0f} s{tail}")
        if returncode != 0 or not result_path.is_file():
            return PeerOutcome(peer, None, f"failed: exit status {returncode}{tail}")
        try:
            result = parse_result(result_path.read_text(), job)
        except ResultError as exc:
            return PeerOutcome(peer, None, f"failed: its result is invalid: {exc}")
    return PeerOutcome(peer, result)


def busy_cores(window_s: float, stat: Path = Path("/proc/stat")) -> float:
    """How many cores' worth of CPU the whole machine used over the next ``window_s``."""

    def read() -> tuple[int, int]:
        fields = [int(f) for f in stat.read_text().splitlines()[0].split()[1:9]]
        return fields[3] + fields[4], sum(fields)  # idle + iowait, all

    idle_0, total_0 = read()
    time.sleep(window_s)
    idle_1, total_1 = read()
    if total_1 == total_0:
        return 0.0
    return (1 - (idle_1 - idle_0) / (total_1 - total_0)) * (os.cpu_count() or 1)


def wait_for_quiet(
    max_wait_s: float,
    what: str,
    *,
    max_busy_cores: float = MAX_QUIET_BUSY_CORES,
    window_s: float = 1.0,
    log: Callable[[str], None] = lambda line: None,
) -> float:
    """Wait (at most ``max_wait_s``) until the machine is quiet before timing ``what``: other
    jobs share these 2 cores, and an engine whose threads spin (llama.cpp's, vLLM's OpenMP
    threads) loses far more than its share to them. Returns the last busy reading."""
    deadline = time.monotonic() + max_wait_s
    busy = busy_cores(window_s)
    while busy > max_busy_cores and time.monotonic() < deadline:
        busy = busy_cores(window_s)
    if busy > max_busy_cores:
        log(f"{what}: the machine is still busy ({busy:.2f} cores) after {max_wait_s:.0f} s")
    return busy


def _run_bounded(
    command: list[str], env: dict[str, str], log: IO[bytes], timeout_s: float
) -> int | None:
    """``command``'s exit status, or None when it ran past ``timeout_s`` (then its whole
    process group, engine workers included, is killed)."""
    child = subprocess.Popen(
        command,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        return child.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None
    finally:
        _kill_group(child)


def _kill_group(child: subprocess.Popen[bytes]) -> None:
    """End whatever the runner left in its process group (vLLM's engine core, say)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)
    child.wait()


def _tail(log_path: Path) -> str:
    text = log_path.read_bytes()[-MAX_LOG_TAIL_CHARS:].decode(errors="replace").strip()
    return f"; its output ends:\n{text}" if text else ""
