"""The engine process: ``python -m sluice.engine_process.child FD``.

It reads an :class:`~sluice.engine_process.wire.EngineSpec` from the socket ``FD``, loads
the model as ``sluice serve`` would, says what it serves, and then runs the engine on its
main thread: the commands that came (a reader thread queues them) between steps, one
message per step. It ignores SIGINT and SIGTERM (the server drains first, then closes the
socket) and exits at the socket's end of file, however the server ended.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import socket
import sys
import threading
from typing import Any

import torch

from sluice.engine.engine import Engine
from sluice.engine.loader import load_checkpoint
from sluice.engine.placement import machine_placement
from sluice.engine.threads import cores_but_one, tuned_threads
from sluice.engine_process.wire import EngineInfo, EngineSpec, frame, recv_message
from sluice.vllm_grpc.tokenizer_bundle import ModelFiles, write_bundle

__all__ = ["main"]

logger = logging.getLogger("sluice.engine_process")


def _load(spec: EngineSpec) -> tuple[Engine, EngineInfo]:
    """The engine ``spec`` asks for, and what it serves (for the server)."""
    threads = spec.engine_threads
    torch.set_num_threads(threads if threads is not None else cores_but_one())
    placement = machine_placement(spec.device, spec.dtype)
    checkpoint = load_checkpoint(spec.model, name=spec.name, placement=placement)
    draft = None
    if spec.draft_model is not None:
        draft = load_checkpoint(spec.draft_model, placement=placement).model
    engine = checkpoint.engine(
        num_blocks=spec.num_blocks,
        max_num_seqs=spec.max_num_seqs,
        speculation=spec.speculation,
        draft_model=draft,
    )
    if threads is None:
        engine.threads = tuned_threads()
    files = ModelFiles(
        checkpoint.tokenizer, checkpoint.chat_template, checkpoint.bos_token, checkpoint.eos_token
    )
    info = EngineInfo(
        checkpoint.name,
        placement.describe(),
        engine.config,
        write_bundle(files, engine.config.max_model_len),
        checkpoint.weight_files,
    )
    return engine, info


def _read_commands(sock: socket.socket, commands: queue.SimpleQueue[tuple[Any, ...]]) -> None:
    """The child's reader thread: every command into the queue; ``stop`` at end of file."""
    try:
        while True:
            commands.put(recv_message(sock))
    except (OSError, EOFError, ValueError):
        commands.put(("stop",))


def _serve(engine: Engine, sock: socket.socket) -> None:
    """The child's main thread: commands between steps, one message per step."""
    commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
    live: set[int] = set()  # the requests added and not yet finished or aborted
    threading.Thread(target=_read_commands, args=(sock, commands), daemon=True).start()

    def send(message: tuple[object, ...]) -> None:
        sock.sendall(frame(message))

    while True:
        command = None if engine.has_unfinished_requests() else commands.get()
        while True:
            if command is not None:
                kind = command[0]
                if kind == "stop":
                    return
                if kind == "add":
                    _, reply_id, prompt, params = command
                    try:
                        request_id = engine.add_request(prompt, params)
                    except Exception as exc:  # admission: QueueFullError, ValueError
                        send(("reply", reply_id, False, exc))
                    else:
                        live.add(request_id)
                        send(("reply", reply_id, True, request_id))
                elif kind == "abort":
                    _, reply_id, request_id = command
                    live.discard(request_id)
                    send(("aborted", reply_id, request_id, engine.abort(request_id)))
                elif kind == "call":
                    _, reply_id, fn = command
                    try:
                        send(("reply", reply_id, True, fn(engine)))
                    except Exception as exc:
                        send(("reply", reply_id, False, exc))
            try:
                command = commands.get_nowait()
            except queue.Empty:
                break
        if not engine.has_unfinished_requests():
            continue
        try:
            outputs = engine.step()
        except Exception:
            logger.exception("engine step failed; failing every live request")
            for request_id in live:  # the engine aborted the batch's; these too
                engine.abort(request_id)
            live.clear()
            send(("step_failed",))
            continue
        items = [(o.request_id, o if o.error is None else o.error) for o in outputs]
        live.difference_update(o.request_id for o in outputs if o.finished)
        send(("step", items, engine.last_step))


def main(fd: int) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server drains first, then closes
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    sock = socket.socket(fileno=fd)
    try:
        spec = recv_message(sock)
        engine, info = _load(spec)
    except Exception as exc:
        with contextlib.suppress(OSError):
            sock.sendall(frame(("failed", f"{type(exc).__name__}: {exc}")))
        return 2
    sock.sendall(frame(("ready", info)))
    with contextlib.suppress(OSError):
        _serve(engine, sock)
    return 0


if __name__ == "__main__":  # pragma: no cover - run as the child
    code = main(int(sys.argv[1]))
    sys.stdout.flush()
    os._exit(code)  # no interpreter teardown (seconds with torch loaded)
