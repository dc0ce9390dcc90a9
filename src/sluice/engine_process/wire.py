"""What crosses the socket between the server and its engine process.

A message is a 4-byte big-endian length and a pickle: both ends are this program, the
child started by the server with the same interpreter and code, so pickle carries
dataclasses, sampling parameters, outputs and exceptions as they are. Messages, as tuples
whose first item names them:

- server to child: :class:`EngineSpec` first, then ``("add", reply_id, prompt_ids,
  params)``, ``("abort", reply_id | None, request_id)``, ``("call", reply_id, fn)``
  (``fn`` a module-level function of the engine);
- child to server: ``("ready", EngineInfo)`` or ``("failed", reason)`` once, then
  ``("reply", reply_id, ok, value_or_exception)``, ``("aborted", reply_id | None,
  request_id, aborted)``, ``("step", [(request_id, RequestOutput | error text)],
  StepStats)`` once per step, and ``("step_failed",)``.
"""

from __future__ import annotations

import pickle
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from sluice.engine.engine import EngineConfig
from sluice.engine.speculative import SpeculativeConfig

__all__ = [
    "HEADER",
    "MAX_MESSAGE_BYTES",
    "EngineInfo",
    "EngineSpec",
    "frame",
    "recv_message",
]

# A message is a step's outputs (tens of KB at 64 sequences) or the tokenizer bundle
# (tokenizers of real models are tens of MB).
MAX_MESSAGE_BYTES: Final = 256 << 20
HEADER: Final = struct.Struct(">I")


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """What the child loads and how it runs it (the options of ``sluice serve``)."""

    model: Path
    name: str | None
    device: str
    dtype: str
    num_blocks: int
    max_num_seqs: int
    engine_threads: int | None  # None: tuned (engine/threads.py)
    speculation: SpeculativeConfig | None = None
    draft_model: Path | None = None


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What a started child serves: the name, where, the engine's limits, the tokenizer
    bundle (:mod:`sluice.vllm_grpc.tokenizer_bundle`) and the weight files."""

    name: str
    placement: str
    config: EngineConfig
    bundle: bytes
    weight_files: tuple[Path, ...]


def frame(message: object) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    parts, needed = [], size
    while needed:
        part = sock.recv(min(needed, 1 << 20))
        if not part:
            raise EOFError("the other end closed the socket")
        parts.append(part)
        needed -= len(part)
    return b"".join(parts)


def recv_message(sock: socket.socket) -> Any:
    (size,) = HEADER.unpack(_recv_exact(sock, HEADER.size))
    if size > MAX_MESSAGE_BYTES:
        raise ValueError(f"a message of {size} bytes is over {MAX_MESSAGE_BYTES}")
    data = _recv_exact(sock, size)
    try:
        return pickle.loads(data)
    except Exception as exc:  # a message this program did not write
        raise ValueError(f"an unreadable message: {exc}") from exc
