"""``sluice worker``: one model in the embedded engine, served over vLLM's gRPC engine protocol.

``sluice worker --model PATH --listen HOST:PORT`` loads the model as ``sluice serve`` would
(the same loader and engine limits; without ``--model``, the default model), warms the engine up, and serves
``vllm.grpc.engine.VllmEngine`` (:mod:`~sluice.vllm_grpc.servicer`) on the address, with
the standard health service (``grpc.health.v1.Health``: ``SERVING`` while it runs) and
server reflection. Port 0 takes a free port; the line printed once it listens names the
one bound (``Sluice worker 0.1.0: serving sluice-tiny on 127.0.0.1:PORT``).

Fronts: ``sluice serve --worker grpc://HOST:PORT`` (:mod:`sluice.backends.worker`), or any
router that speaks the protocol (smg's ``--backend vllm``).

SIGTERM or SIGINT stops it: health turns ``NOT_SERVING``, live calls get
``--shutdown-timeout`` seconds to end, then they are cancelled (their engine requests
aborted) and the engine thread stops.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from pathlib import Path
from typing import Final

import grpc
import torch

from sluice import __version__
from sluice.engine.default_model import (
    DEFAULT_MODEL_NAME,
    DEFAULT_MODEL_PACKAGE,
    default_model_file,
)
from sluice.engine.driver import AsyncEngine
from sluice.engine.engine import EngineConfig
from sluice.engine.loader import Checkpoint, load_checkpoint
from sluice.engine.models.llama import LlamaConfig
from sluice.engine.placement import add_placement_arguments, machine_placement
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.threads import cores_but_one
from sluice.errors import ConfigError
from sluice.grpc_api import hosting
from sluice.startup import freeze_startup_objects
from sluice.vllm_grpc.proto import SERVICE
from sluice.vllm_grpc.servicer import EngineServicer, ServedModel
from sluice.vllm_grpc.tokenizer_bundle import ModelFiles, write_bundle

__all__ = ["MAX_RECEIVE_BYTES", "add_arguments", "parse_address", "run"]

logger = logging.getLogger("sluice.worker")

# A request is its prompt's token ids (4-5 bytes each): 16 MiB is millions of tokens.
MAX_RECEIVE_BYTES: Final = 16 << 20
KEEPALIVE_S: Final = 15.0
_ARCHITECTURES: Final = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}
_WARM_UP_TEXT: Final = "Return the number of items in the sequence."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``sluice worker``."""
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        metavar="PATH",
        help="the GPT-2 or Llama model to serve: a Hugging Face-format checkpoint directory "
        "or a GGUF file (as sluice serve --model; default: SmolLM2-135M-Instruct from the "
        f"{DEFAULT_MODEL_PACKAGE} package, as '{DEFAULT_MODEL_NAME}')",
    )
    parser.add_argument(
        "--listen",
        default="127.0.0.1:50051",
        metavar="HOST:PORT",
        help="address to serve gRPC on (port 0: a free one, printed at start)",
    )
    parser.add_argument(
        "--kv-blocks", type=int, default=1024, help="KV-cache blocks of the engine (16 tokens each)"
    )
    parser.add_argument(
        "--max-running", type=int, default=64, help="sequences the engine runs in one batch"
    )
    add_placement_arguments(parser)
    parser.add_argument(
        "--engine-threads",
        type=int,
        default=cores_but_one(),
        help="torch threads of the engine (default: the usable cores but one, at least 1, "
        "as sluice serve --no-engine-process: the gRPC event loop keeps a core)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT, how long live calls get to end before they are cancelled",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="logging verbosity",
    )


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) as a host and a port; :class:`ConfigError` else."""
    host, sep, port_text = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port_text.isdigit() or int(port_text) > 65535:
        raise ConfigError(f"{text!r} is not HOST:PORT")
    return host, int(port_text)


def _served_model(checkpoint: Checkpoint, path: Path, config: EngineConfig) -> ServedModel:
    files = ModelFiles(
        checkpoint.tokenizer,
        checkpoint.chat_template,
        checkpoint.bos_token,
        checkpoint.eos_token,
    )
    model_type = "llama" if isinstance(checkpoint.config, LlamaConfig) else "gpt2"
    return ServedModel(
        name=checkpoint.name,
        path=str(path),
        model_type=model_type,
        architecture=_ARCHITECTURES[model_type],
        tokenizer=checkpoint.tokenizer,
        bundle=write_bundle(files, config.max_model_len),
    )


async def _warm_up(driver: AsyncEngine, model: ServedModel) -> None:
    """A throwaway greedy request, so torch's first-call costs are paid before a client's."""
    prompt = model.tokenizer.encode(_WARM_UP_TEXT)[:8] or [0]
    stream = await driver.add_request(prompt, SamplingParams(4, temperature=0, ignore_eos=True))
    async for _ in stream:
        pass


async def _serve(
    driver: AsyncEngine, model: ServedModel, host: str, port: int, shutdown_timeout_s: float
) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with driver:
        await _warm_up(driver, model)
        server = grpc.aio.server(
            options=(
                ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
                ("grpc.keepalive_time_ms", int(KEEPALIVE_S * 1000)),
                ("grpc.so_reuseport", 0),
            )
        )
        server.add_generic_rpc_handlers((EngineServicer(driver, model).handler(),))
        bound, health_servicer = await hosting.start(server, SERVICE, host, port)
        freeze_startup_objects()  # full collections walk only what serving makes (startup.py)
        shown = f"[{host}]" if ":" in host else host
        print(f"Sluice worker {__version__}: serving {model.name} on {shown}:{bound}", flush=True)
        await stop.wait()
        logger.info("stopping: live calls get %.1f s", shutdown_timeout_s)
        await health_servicer.enter_graceful_shutdown()
        await server.stop(shutdown_timeout_s)


def run(args: argparse.Namespace) -> int:
    """Run ``sluice worker`` until a signal; the exit status."""
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.engine_threads < 1:
        print("sluice worker: --engine-threads must be at least 1", file=sys.stderr)
        return 2
    torch.set_num_threads(args.engine_threads)  # process-wide, before the model loads
    try:
        host, port = parse_address(args.listen)
        name = None
        if args.model is None:
            args.model, name = default_model_file(), DEFAULT_MODEL_NAME
        placement = machine_placement(args.device, args.dtype)
        checkpoint = load_checkpoint(args.model, name=name, placement=placement)
        engine = checkpoint.engine(num_blocks=args.kv_blocks, max_num_seqs=args.max_running)
    except (OSError, ValueError) as exc:
        print(f"sluice worker: {exc}", file=sys.stderr)
        return 2
    model = _served_model(checkpoint, args.model, engine.config)
    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_serve(AsyncEngine(engine), model, host, port, args.shutdown_timeout))
    except ConfigError as exc:
        print(f"sluice worker: {exc}", file=sys.stderr)
        return 2
    return 0
