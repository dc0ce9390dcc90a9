"""The ``sluice`` command: ``sluice serve`` runs the server, ``sluice worker`` an engine worker."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import ipaddress
import logging
import math
import os
import socket
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Literal

import torch
import uvicorn

from sluice import __version__, loadgen
from sluice.backends.base import Backend
from sluice.backends.chat import ChatTemplate
from sluice.backends.engine import EngineBackend, EngineDriver
from sluice.backends.prompt import PromptEncoder
from sluice.backends.upstream_config import (
    UpstreamSpec,
    list_upstream_models,
    load_upstream_config,
)
from sluice.backends.worker import WorkerBackend
from sluice.backends.worker_pool import WorkerOptions, WorkerPool
from sluice.dialects.base import RequestLimits
from sluice.engine.default_model import (
    DEFAULT_MODEL_NAME,
    DEFAULT_MODEL_PACKAGE,
    default_model_file,
)
from sluice.engine.driver import AsyncEngine
from sluice.engine.loader import load_checkpoint
from sluice.engine.model_runner import PagedModel
from sluice.engine.placement import Placement, add_placement_arguments, machine_placement
from sluice.engine.speculative import SpeculativeConfig
from sluice.engine.threads import cores_but_one
from sluice.engine_process import EngineReplicas, EngineSpec, ProcessEngine, start_child
from sluice.errors import ConfigError
from sluice.gateway.app import SluiceApp, create_app
from sluice.gateway.auth import (
    DEFAULT_TOKEN_TTL_S,
    Auth,
    ResumeTokens,
    load_key_file,
    parse_key_list,
)
from sluice.gateway.settings import (
    DEFAULT_MAX_RETAINED_STREAMS_PER_TENANT,
    DEFAULT_MAX_STREAMS_PER_TENANT,
    DEFAULT_TENANT_LOG_SHARE,
    Settings,
)
from sluice.observability.logs import LOG_FORMATS, configure_logging
from sluice.startup import freeze_startup_objects
from sluice.streams.log import LogLimits
from sluice.streams.redis_hub import DEFAULT_LEASE_S, ClusterSettings
from sluice.streams.shared import REDIS_URL_ENV, SharedStreams, shared_token_secret
from sluice.transports.delivery import DeliveryOptions
from sluice.transports.durable import DurableOptions
from sluice.transports.http1.opener import Http1Limits
from sluice.transports.http1.uvicorn_adapter import (
    SluiceWebSocketProtocol,
    exit_without_reraise,
    protocol_class,
)
from sluice.transports.http2 import Http2Options, check_tls
from sluice.vllm_grpc.client import WorkerDescription, describe_worker
from sluice.vllm_grpc.tokenizer_bundle import read_bundle
from sluice.vllm_grpc.worker import add_arguments as add_worker_arguments
from sluice.vllm_grpc.worker import run as run_worker

if TYPE_CHECKING:
    from sluice.rollout.controller import Rollouts

__all__ = ["BUNDLED_MODEL", "build_parser", "main"]

logger = logging.getLogger("sluice.serve")

# The tiny GPT-2 the repository ships (see scripts/train_tiny_model.py), for tests.
BUNDLED_MODEL = Path(__file__).resolve().parents[2] / "models" / "sluice-tiny"

# After a second SIGTERM ended the live streams, the longest the server waits for their
# producers to write the error before it stops anyway (a backend's abort is quick; this
# only bounds one that is not).
_END_NOW_FLUSH_S = 2.0
# --engine-process: how long start-up waits for the child to load the model.
_ENGINE_START_TIMEOUT_S = 600.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluice",
        description="Sluice: resumable, cancellable LLM token streams over Server-Sent Events.",
    )
    parser.add_argument("--version", action="version", version=f"sluice {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    defaults = Settings()
    serve = commands.add_parser(
        "serve",
        help="run the HTTP server",
        description="Run the Sluice HTTP server (browser page at /, native API under /v1).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    serve.add_argument(
        "--http2",
        action="store_true",
        help="also serve HTTP/2 (and HTTP/1.1) on --http2-port: h2c with prior knowledge, "
        "or over TLS with ALPN given --ssl-certfile and --ssl-keyfile",
    )
    serve.add_argument(
        "--http2-port",
        type=int,
        default=None,
        metavar="PORT",
        help="the HTTP/2 listener's port on --host (implies --http2; default: --port + 1)",
    )
    serve.add_argument(
        "--ssl-certfile",
        type=Path,
        default=None,
        metavar="PEM",
        help="the HTTP/2 listener's TLS certificate chain (with --ssl-keyfile)",
    )
    serve.add_argument(
        "--ssl-keyfile",
        type=Path,
        default=None,
        metavar="PEM",
        help="the HTTP/2 listener's TLS private key",
    )
    serve.add_argument(
        "--grpc-port",
        type=int,
        default=None,
        metavar="PORT",
        help="also serve the gRPC API (sluice.v1.Streams, health, reflection) on this port "
        "of --host (default: no gRPC)",
    )
    serve.add_argument(
        "--fd",
        type=int,
        default=None,
        help="serve on this inherited, already listening socket instead of --host/--port "
        "(socket activation; --host/--port then only label the page URL)",
    )
    serve.add_argument(
        "--model",
        type=Path,
        default=None,
        metavar="PATH",
        help="serve this GPT-2 or Llama model with the embedded engine, as the default model: "
        "a Hugging Face-format checkpoint directory (config.json, *.safetensors, "
        "tokenizer.json), served under the directory's name, or a GGUF file (or a directory "
        "holding one), served under the file's name (default: SmolLM2-135M-Instruct from the "
        f"{DEFAULT_MODEL_PACKAGE} package, as '{DEFAULT_MODEL_NAME}', unless upstreams or "
        "workers are configured; the bundled test model is models/sluice-tiny)",
    )
    serve.add_argument(
        "--no-model",
        action="store_true",
        help="load no model into the embedded engine",
    )
    serve.add_argument(
        "--upstream",
        metavar="URL",
        help="proxy an OpenAI-compatible server (vLLM, TGI, llama.cpp, Ollama, OpenAI) at "
        "this API root, e.g. http://127.0.0.1:8001/v1",
    )
    serve.add_argument(
        "--upstream-model",
        action="append",
        metavar="NAME",
        help="a model of --upstream to serve, under the same name (repeatable; default: "
        "every model its /models lists at start-up)",
    )
    serve.add_argument(
        "--upstream-key",
        default=os.environ.get("SLUICE_UPSTREAM_KEY"),
        metavar="KEY",
        help="bearer key for --upstream (default: $SLUICE_UPSTREAM_KEY)",
    )
    serve.add_argument(
        "--upstream-connect-timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="connect timeout for --upstream",
    )
    serve.add_argument(
        "--upstream-read-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="longest silence from --upstream before the stream fails",
    )
    serve.add_argument(
        "--upstream-config",
        type=Path,
        metavar="FILE",
        help="a TOML file of [[upstream]] tables (name, base_url, model, api_key_env, "
        "connect_timeout_s, read_timeout_s) to proxy several upstreams",
    )
    serve.add_argument(
        "--worker",
        action="append",
        default=None,
        metavar="URL",
        help="stream from an engine worker at grpc://HOST:PORT (sluice worker, or any server "
        "of vLLM's gRPC engine protocol), serving the model it serves; repeatable: each "
        "request goes to the least loaded worker of its model",
    )
    serve.add_argument(
        "--worker-connect-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how long start-up waits for each --worker to answer",
    )
    serve.add_argument(
        "--models-config",
        type=Path,
        metavar="FILE",
        help="a TOML file of [[alias]] tables: public model names whose versions (served "
        "models, or words with fault options) get weighted, sticky shares of streams and "
        "canary releases (README: Canary releases)",
    )
    serve.add_argument(
        "--rollout-state",
        type=Path,
        metavar="FILE",
        help="where the aliases' rollouts (weights, decisions, evidence) are kept across "
        "restarts, written atomically (default: not kept)",
    )
    serve.add_argument(
        "--kv-blocks",
        type=int,
        default=1024,
        help="KV-cache blocks of the embedded engine (16 tokens each)",
    )
    serve.add_argument(
        "--max-running",
        type=int,
        default=64,
        help="sequences the embedded engine runs in one batch",
    )
    serve.add_argument(
        "--draft-model",
        default=None,
        metavar="DIR",
        help="speculative decoding with this draft model (same tokenizer as --model): it "
        "proposes tokens that the model verifies in one pass; output is exactly the model's",
    )
    serve.add_argument(
        "--speculative",
        choices=("draft", "ngram"),
        default=None,
        help="speculative decoding: 'draft' (with --draft-model, its default) or 'ngram' "
        "(prompt lookup: drafts what followed the latest repeat of the last few tokens, for "
        "any model)",
    )
    serve.add_argument(
        "--num-speculative-tokens",
        type=_count,
        default=6,
        metavar="K",
        help="the most tokens drafted per sequence and step (default 6); the engine picks "
        "0..K each step from the measured acceptance and step costs",
    )
    serve.add_argument(
        "--fixed-speculative-tokens",
        action="store_true",
        help="draft exactly --num-speculative-tokens every step (no adaptive k)",
    )
    add_placement_arguments(serve)
    serve.add_argument(
        "--engine-threads",
        type=_threads,
        default=None,
        metavar="N|auto",
        help="torch threads of the embedded engine (default: auto; in the engine's child "
        "process, tuned by timing its own steps between the usable cores but one and every "
        "core, as the machine's other load makes either faster; with --no-engine-process, "
        "the cores but one, at least 1: the event loop keeps a core)",
    )
    serve.add_argument(
        "--engine-replicas",
        type=_count,
        default=1,
        metavar="N",
        help="run N engines, each in a child process of its own with 1/N of the KV cache "
        "and of --max-running, as one: a request goes to the one with the fewest live "
        "requests (default 1). Each gets the usable cores / N torch threads unless "
        "--engine-threads says otherwise. For a small model on a small CPU machine shared "
        "with the server and its clients: engines of one thread each lose nothing to "
        "threads waiting for each other (sluice-tiny, 2 on 2 cores: about 15%% more tokens/s "
        "at 64 streams); but one request's steps run on fewer cores, each replica loads the "
        "model and keeps its own prefix cache, and a model bound by reading its weights "
        "loses (SmolLM2-135M: a third)",
    )
    serve.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the embedded engine in a child process of its own (started with the "
        "server, stopped with it, started again if it dies), so that its steps and the "
        "server's event loop do not share one interpreter's lock; the model, placement, "
        "KV-cache and speculation options apply to it as they are (default on; "
        "--no-engine-process keeps the engine on a thread of the server)",
    )
    serve.add_argument(
        "--heartbeat-interval",
        type=float,
        default=defaults.delivery.heartbeat_interval_s,
        metavar="SECONDS",
        help="idle seconds before an SSE stream gets a ': ping' comment",
    )
    serve.add_argument(
        "--retry",
        type=int,
        default=defaults.delivery.retry_ms,
        metavar="MS",
        help="reconnection delay hinted to EventSource clients (SSE 'retry:' field)",
    )
    serve.add_argument(
        "--grace",
        type=float,
        default=defaults.default_grace_s,
        metavar="SECONDS",
        help="how long a resumable stream with no reader waits for one before it is cancelled",
    )
    serve.add_argument(
        "--retention",
        type=float,
        default=defaults.retention_s,
        metavar="SECONDS",
        help="how long a finished stream stays readable for late reconnects",
    )
    serve.add_argument(
        "--max-streams",
        type=int,
        default=defaults.max_streams,
        help="live streams held at once; more are refused with 503 (finished streams kept "
        "for --retention count too, but a new stream evicts the oldest of them)",
    )
    serve.add_argument(
        "--max-connections",
        type=int,
        default=None,
        metavar="N",
        help="connections inside a request (head received, response not complete; an SSE "
        "stream for its whole life) served at once; a request that would make one more is "
        "refused (503 + Retry-After; an SSE read gets a 'retry:' hint) and its connection "
        "closed. Idle and half-sent connections do not count: --head-timeout closes them "
        "(default: no limit)",
    )
    serve.add_argument(
        "--head-timeout",
        type=float,
        default=defaults.http.head_timeout_s,
        metavar="SECONDS",
        help="a request head must arrive within this of the connection (kept alive: of its "
        "first byte); else 408 and close (a silent connection is just closed)",
    )
    serve.add_argument(
        "--body-timeout",
        type=float,
        default=defaults.http.body_timeout_s,
        metavar="SECONDS",
        help="a request body must arrive whole within this of its head; else 408 (or, "
        "once a response has started, a close)",
    )
    serve.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="an idle kept-alive connection is closed after this, after any response",
    )
    serve.add_argument(
        "--max-streams-per-tenant",
        type=_auto(_count),
        default="auto",
        metavar="N",
        help="live streams one tenant may hold; more are refused with 429 ('auto': "
        f"{DEFAULT_MAX_STREAMS_PER_TENANT} with API keys, else --max-streams: without keys "
        "the one tenant, 'anonymous', gets the server's limits)",
    )
    serve.add_argument(
        "--log-memory-budget",
        type=_byte_size,
        default="1GiB",
        metavar="SIZE",
        help="memory of all event logs, live and retained (e.g. 512MiB, 2GiB; a bare number "
        "is MiB): finished streams are evicted oldest first to stay within it, a new "
        "stream that cannot fit is refused (503) and a growing one drops its oldest events",
    )
    serve.add_argument(
        "--max-log-bytes-per-tenant",
        type=_auto(_byte_size),
        default="auto",
        metavar="SIZE",
        help="memory of one tenant's event logs, live and retained; its oldest finished "
        "streams are evicted first, then a new stream is refused (429) ('auto': "
        f"1/{DEFAULT_TENANT_LOG_SHARE} of --log-memory-budget with API keys, all of it "
        "without)",
    )
    serve.add_argument(
        "--max-retained-streams-per-tenant",
        type=_auto(_count),
        default="auto",
        metavar="N",
        help="finished streams one tenant keeps readable; past it, its oldest is evicted "
        f"('auto': {DEFAULT_MAX_RETAINED_STREAMS_PER_TENANT} with API keys, --max-streams "
        "without)",
    )
    serve.add_argument(
        "--max-tokens-per-stream",
        type=int,
        default=defaults.max_tokens_per_stream,
        help="token events one stream may produce (larger max_tokens are clamped)",
    )
    serve.add_argument(
        "--max-stream-duration",
        type=float,
        default=defaults.max_stream_s,
        metavar="SECONDS",
        help="creation to end of one stream; a longer one ends with done: length",
    )
    serve.add_argument(
        "--send-timeout",
        type=float,
        default=defaults.delivery.send_timeout_s,
        metavar="SECONDS",
        help="an SSE connection whose socket takes nothing for this long is closed (it may "
        "resume); also the kernel's deadline for unacknowledged data (dead peers)",
    )
    serve.add_argument(
        "--coalesce",
        action=argparse.BooleanOptionalAction,
        default=defaults.delivery.coalesce,
        help="send a lagging native reader its waiting tokens as one event",
    )
    serve.add_argument(
        "--ttft-slo",
        type=float,
        default=None,
        metavar="SECONDS",
        help="refuse (503 + Retry-After) an engine request whose predicted time to first "
        "token (a replay of the engine's scheduler with measured step costs, plus the time "
        "the request already waited) is over this (default: off)",
    )
    serve.add_argument(
        "--ttft-headroom",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="with --ttft-slo: the part of the objective kept for what the server cannot "
        "see, the first token's way out through its event loop, the network and the client "
        "(default: %(default)s)",
    )
    serve.add_argument(
        "--max-log-events",
        type=int,
        default=defaults.log.max_records,
        help="events kept per stream for replay; older ones are dropped (a resume before "
        "them gets a 'resume_gap' error event)",
    )
    serve.add_argument(
        "--max-prompt-chars",
        type=int,
        default=defaults.requests.max_prompt_chars,
        help="longest prompt or demo text accepted",
    )
    serve.add_argument(
        "--ds-long-poll",
        type=float,
        default=defaults.durable.long_poll_s,
        metavar="SECONDS",
        help="how long a Durable Streams long-poll (/v1/ds/..., live=long-poll) waits at "
        "the tail before its 204",
    )
    serve.add_argument(
        "--cors-origin",
        action="append",
        default=None,
        metavar="ORIGIN",
        help="web origin (scheme://host[:port], or '*' for any) other than the server's own "
        "that may call the API from a browser (repeatable; default: none while callers "
        "without a key are served, any origin when every caller needs a key)",
    )
    serve.add_argument(
        "--allowed-host",
        action="append",
        default=None,
        metavar="NAME",
        help="a Host name answered besides loopback ones, for a proxy that passes on its own "
        "(repeatable; .example.com: the domain and the names under it; '*': any); default "
        "on loopback: loopback names only while callers without a key are served (DNS "
        "rebinding), any with keys; on another address: any (name the ones clients use to "
        "refuse DNS-rebound pages there too)",
    )
    serve.add_argument(
        "--auth-config",
        type=Path,
        metavar="FILE",
        help="a TOML file of [[key]] tables (tenant, and key_sha256 = hex SHA-256 of the key "
        "or key_env = the environment variable holding it): API keys, sent as "
        "'Authorization: Bearer KEY' or 'x-api-key: KEY'; $SLUICE_API_KEYS "
        "('tenant1:key1,tenant2:key2') adds more",
    )
    serve.add_argument(
        "--allow-anonymous",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="serve callers without a key as tenant 'anonymous' (default: only when no keys "
        "are configured and --host is a loopback address; with no keys on another host, "
        "sluice serve refuses to start)",
    )
    serve.add_argument(
        "--token-secret",
        default=None,
        metavar="SECRET",
        help="HMAC key (16+ bytes) that signs resume tokens; prefer $SLUICE_TOKEN_SECRET "
        "(command lines are visible to other users); default: random per process, so tokens "
        "die with it",
    )
    serve.add_argument(
        "--redis",
        default=os.environ.get(REDIS_URL_ENV) or None,
        metavar="URL",
        help="keep streams in this Redis (redis://HOST:PORT/DB, or redis+cluster://HOST:PORT "
        "for any node of a Redis Cluster), shared by every replica that names it: any "
        "replica serves any read, resume, status or cancel "
        f"(default: ${REDIS_URL_ENV}; unset: in this process's memory)",
    )
    serve.add_argument(
        "--producer-lease",
        type=float,
        default=DEFAULT_LEASE_S,
        metavar="SECONDS",
        help="with --redis: a replica that stops renewing the lease of the streams it "
        "produces for this long is presumed dead; each gets one retryable error event",
    )
    serve.add_argument(
        "--token-ttl",
        type=float,
        default=DEFAULT_TOKEN_TTL_S,
        metavar="SECONDS",
        help="lifetime of a resume token (at most a day)",
    )
    serve.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT, how long live streams get to finish while new ones are "
        "refused (503) and /readyz says 503; the rest then end with a retryable error",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="on SIGINT/SIGTERM, how long open streams get before they are closed",
    )
    serve.add_argument(
        "--native-sse",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve SSE reads and the compatible APIs (chat/completions, completions, "
        "messages, ...) with Sluice's callback-driven HTTP protocol; with "
        "--no-native-sse they go through the ASGI app like every other request, as under "
        "any ASGI server (the connection deadlines and limits apply either way)",
    )
    serve.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="logging verbosity",
    )
    serve.add_argument(
        "--log-format",
        default="text",
        choices=LOG_FORMATS,
        help="'json': one JSON object per line on stderr (ts, level, logger, message; "
        "stream_id, model, tenant where a line is about a stream), uvicorn's lines too",
    )
    serve.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="log every HTTP request, and every stream when it ends (id, model, tenant, "
        "outcome, tokens, seconds)",
    )
    worker = commands.add_parser(
        "worker",
        help="serve one model's engine over vLLM's gRPC engine protocol",
        description="Serve the embedded engine as vllm.grpc.engine.VllmEngine (Generate, "
        "Abort, HealthCheck, GetModelInfo, GetLoads, GetTokenizer), for sluice serve "
        "--worker or any router that speaks the protocol.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_worker_arguments(worker)
    bench = commands.add_parser(
        "bench",
        help="load an OpenAI-compatible or native endpoint; report TTFT, ITL, tokens/s",
        description="Load an OpenAI-compatible or native Sluice endpoint at a concurrency or "
        "request-rate sweep and report TTFT, inter-token latency, tokens/s, errors and "
        "refusals (p50/p90/p99) as a table and JSON.",
    )
    loadgen.add_arguments(bench)
    return parser


_BYTE_UNITS = {"": 2**20, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def _byte_size(text: str) -> int:
    """A size such as ``64MiB`` or ``1.5GiB`` (a bare number is MiB), in bytes."""
    number = text.strip().rstrip("BbIiKkMmGg")
    unit = text.strip()[len(number) :].lower()
    try:
        size = float(number) * _BYTE_UNITS[unit]
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size (a number of B, KiB, MiB or GiB)"
        ) from None
    if not 0 < size < 2**63:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive and finite")
    return int(size)


def _threads(text: str) -> int | None:
    """``auto`` (``None``: tuned), or a whole number of at least 1."""
    return None if text == "auto" else _count(text)


def _count(text: str) -> int:
    """A whole number of at least 1."""
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if count < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return count


def _auto(parse: Callable[[str], int]) -> Callable[[str], int | None]:
    """``parse``, where ``auto`` means the default that depends on the keys (``None``)."""

    def parse_or_auto(text: str) -> int | None:
        return None if text == "auto" else parse(text)

    parse_or_auto.__name__ = parse.__name__  # argparse names the type in its errors
    return parse_or_auto


def _settings(args: argparse.Namespace) -> Settings:
    try:
        delivery = DeliveryOptions(
            heartbeat_interval_s=args.heartbeat_interval,
            retry_ms=args.retry,
            send_timeout_s=args.send_timeout,
            coalesce=args.coalesce,
        )
        http = Http1Limits(head_timeout_s=args.head_timeout, body_timeout_s=args.body_timeout)
        log = LogLimits(max_records=args.max_log_events)
        durable = DurableOptions(long_poll_s=args.ds_long_poll)
        shared = None
        if args.redis:
            lease_s = args.producer_lease
            cluster = ClusterSettings(lease_s=lease_s, heartbeat_s=lease_s / 5)
            shared = SharedStreams(args.redis, cluster)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    return Settings(
        delivery=delivery,
        log=log,
        shared=shared,
        requests=RequestLimits(max_prompt_chars=args.max_prompt_chars),
        http=http,
        durable=durable,
        default_grace_s=args.grace,
        retention_s=args.retention,
        max_streams=args.max_streams,
        cors_allow_origins=None if args.cors_origin is None else tuple(args.cors_origin),
        allowed_hosts=_allowed_hosts(args),
        max_streams_per_tenant=args.max_streams_per_tenant,
        log_budget_bytes=args.log_memory_budget,
        max_log_bytes_per_tenant=args.max_log_bytes_per_tenant,
        max_retained_streams_per_tenant=args.max_retained_streams_per_tenant,
        max_tokens_per_stream=args.max_tokens_per_stream,
        max_stream_s=args.max_stream_duration,
        grpc_port=args.grpc_port,
        grpc_host=args.host,
        http2=_http2(args),
    )


def _http2(args: argparse.Namespace) -> Http2Options | None:
    """The HTTP/2 listener the options ask for, if any."""
    wanted = args.http2 or args.http2_port is not None
    if not wanted:
        if args.ssl_certfile is not None or args.ssl_keyfile is not None:
            raise ConfigError("--ssl-certfile and --ssl-keyfile are for --http2")
        return None
    port = args.port + 1 if args.http2_port is None else args.http2_port
    for path in (args.ssl_certfile, args.ssl_keyfile):
        if path is not None and not path.is_file():
            raise ConfigError(f"no such file: {path}")
    options = Http2Options(
        args.host, port, args.ssl_certfile, args.ssl_keyfile, native=args.native_sse
    )
    check_tls(options)
    return options


def _allowed_hosts(args: argparse.Namespace) -> tuple[str, ...] | None:
    """``--allowed-host``; without it, the app's default on loopback (see
    :mod:`sluice.gateway.hosts`), and any name on another address: the names clients use
    there are not known (``0.0.0.0``), and without keys the operator chose to serve
    whoever connects (``--allow-anonymous``); naming them refuses DNS-rebound pages too."""
    if args.allowed_host is not None:
        return tuple(args.allowed_host)
    return None if _on_loopback(args) else ("*",)


class _Server(uvicorn.Server):
    """uvicorn's server, where SIGTERM drains first, then stops, and exits 0.

    The first SIGTERM (or SIGINT) starts the drain: ``/readyz`` turns 503 and new streams
    are refused (503 + ``Retry-After``) while the listener stays open, live streams get
    ``drain_timeout_s`` to finish, and the rest end on an event boundary with a retryable
    error. Then uvicorn's own shutdown runs. A second signal is the drain's deadline, now:
    every live stream, in every dialect and on either SSE path, ends at once with that
    retryable error, which its writer still delivers; then the server stops (after
    ``_END_NOW_FLUSH_S`` at most, should a producer not end). A third signal stops without
    waiting. uvicorn re-raises the signal it shut down for, so the process would die of
    SIGTERM after draining; a supervisor (systemd, Kubernetes) asked for exactly this stop.
    """

    def __init__(self, config: uvicorn.Config, app: SluiceApp, drain_timeout_s: float) -> None:
        super().__init__(config)
        self._app = app
        self._drain_timeout_s = drain_timeout_s
        self._drain: asyncio.Task[None] | None = None
        self._ending_now = False  # a second signal ended the live streams
        self._stopping = False  # uvicorn's shutdown was asked for
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        # The app, the model and the runtime are built: full collections walk only what
        # serving makes from now on (sluice.startup).
        freeze_startup_objects()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler runs between any two bytecodes: hand over to the loop.
        loop = self._loop
        if loop is not None and self._app.hub.running_now:
            loop.call_soon_threadsafe(self._start_drain, sig)
            return
        self._exit(sig, frame)

    def _start_drain(self, sig: int) -> None:
        loop = asyncio.get_running_loop()
        if self._drain is None:
            self._drain = loop.create_task(self._drain_then_exit(sig))
        elif not self._ending_now:
            # A second signal: the drain's deadline is now. The drain then sees the last
            # producer write its error and stops the server.
            self._ending_now = True
            num_ended = self._app.runtime.end_live_streams()
            logger.info("second signal: ending %d live streams now", num_ended)
            loop.call_later(_END_NOW_FLUSH_S, self._stop, sig)
        else:
            self._exit(sig, None)  # a third signal: stop now

    async def _drain_then_exit(self, sig: int) -> None:
        logger.info("draining: %d live streams", len(self._app.hub.live_streams()))
        try:
            await self._app.runtime.drain(self._drain_timeout_s)
        finally:
            self._stop(sig)

    def _stop(self, sig: int) -> None:
        if not self._stopping:
            self._stopping = True
            self._exit(sig, None)

    def _exit(self, sig: int, frame: FrameType | None) -> None:
        exit_without_reraise(self, sig, frame)


def _embedded_engine(
    args: argparse.Namespace, name: str | None = None
) -> tuple[str, Backend, contextlib.AbstractAsyncContextManager[object]]:
    """Load ``--model`` (under ``name``, if given) and put the embedded engine behind the
    Backend seam, on a thread of this process or, with ``--engine-process``, in a child
    process; the third item runs the engine (warmed up) for the app's lifetime."""
    if args.engine_process:
        return _engine_in_child(args, name)
    if args.engine_replicas > 1:
        raise ConfigError("--engine-replicas needs --engine-process")
    # Process-wide; a torch thread per core would share the cores with the event loop,
    # and each of its parallel sections waits for the slowest (measured on 2 loaded vCPUs:
    # 2 threads ran a step 3-16x slower than 1).
    threads = args.engine_threads
    torch.set_num_threads(cores_but_one() if threads is None else threads)
    placement = machine_placement(args.device, args.dtype)
    checkpoint = load_checkpoint(args.model, name=name, placement=placement)
    print(f"Sluice: {checkpoint.name} on {placement.describe()}", flush=True)
    speculation, draft_model = _speculation(args, placement)
    engine = checkpoint.engine(
        num_blocks=args.kv_blocks,
        max_num_seqs=args.max_running,
        speculation=speculation,
        draft_model=draft_model,
    )
    driver = AsyncEngine(engine)
    template = None
    if checkpoint.chat_template is not None:
        template = ChatTemplate(
            checkpoint.chat_template, bos_token=checkpoint.bos_token, eos_token=checkpoint.eos_token
        )
    backend = _engine_backend(
        args, checkpoint.name, driver, checkpoint.tokenizer, template, checkpoint.weight_files
    )
    return checkpoint.name, backend, _warm_engine(driver, backend)


def _engine_in_child(
    args: argparse.Namespace, name: str | None
) -> tuple[str, Backend, contextlib.AbstractAsyncContextManager[object]]:
    """``--engine-process``: the engine in a child process (:mod:`sluice.engine_process`),
    or ``--engine-replicas`` of them; the tokenizer and template come from it, as a worker's
    do."""
    method, config = _speculative_config(args)
    replicas = args.engine_replicas
    if replicas > min(args.kv_blocks, args.max_running):
        raise ConfigError(
            f"--engine-replicas {replicas} needs at least as many --kv-blocks and --max-running"
        )
    threads = args.engine_threads
    if threads is None and replicas > 1:  # a share of the cores each, not tuned
        threads = max(1, len(os.sched_getaffinity(0)) // replicas)
    spec = EngineSpec(
        model=args.model,
        name=name,
        device=args.device,
        dtype=args.dtype,
        num_blocks=args.kv_blocks // replicas,
        max_num_seqs=args.max_running // replicas,
        engine_threads=threads,
        speculation=config,
        draft_model=None if method != "draft" else Path(args.draft_model),
    )
    children = []
    try:
        for _ in range(replicas):
            children.append(start_child(spec, _ENGINE_START_TIMEOUT_S))
    except RuntimeError as exc:
        for started in children:
            started.kill()
        raise ConfigError(str(exc)) from exc
    info = children[0].info
    pids = ", ".join(str(child.process.pid) for child in children)
    where = "process" if replicas == 1 else f"{replicas} processes"
    print(f"Sluice: {info.name} on {info.placement}, in {where} {pids}", flush=True)
    files = read_bundle(info.bundle)
    template = None
    if files.chat_template is not None:
        template = ChatTemplate(
            files.chat_template, bos_token=files.bos_token, eos_token=files.eos_token
        )
    engines = [ProcessEngine(spec, child) for child in children]
    driver: ProcessEngine | EngineReplicas = (
        engines[0] if replicas == 1 else EngineReplicas(engines)
    )
    backend = _engine_backend(args, info.name, driver, files.tokenizer, template, info.weight_files)
    return info.name, backend, _warm_engine(driver, backend)


def _engine_backend(
    args: argparse.Namespace,
    name: str,
    driver: EngineDriver,
    tokenizer: PromptEncoder,
    template: ChatTemplate | None,
    weight_files: tuple[Path, ...],
) -> EngineBackend:
    return EngineBackend(
        name,
        driver,
        tokenizer,
        default_max_tokens=128,
        chat_template=template,
        version=_weights_version(weight_files),
        ttft_slo_s=args.ttft_slo,
        ttft_headroom_s=args.ttft_headroom,
    )


def _speculation(
    args: argparse.Namespace, placement: Placement
) -> tuple[SpeculativeConfig | None, PagedModel | None]:
    """Speculative decoding as ``--speculative`` and ``--draft-model`` ask (off without
    either); :class:`ConfigError` for a combination that cannot run."""
    method, config = _speculative_config(args)
    draft = (
        None if method != "draft" else load_checkpoint(args.draft_model, placement=placement).model
    )
    return config, draft


def _speculative_config(
    args: argparse.Namespace,
) -> tuple[Literal["draft", "ngram"] | None, SpeculativeConfig | None]:
    """The method and configuration ``--speculative`` and ``--draft-model`` ask for (None
    without either); :class:`ConfigError` for a combination that cannot run."""
    method: Literal["draft", "ngram"] | None = args.speculative or (
        "draft" if args.draft_model is not None else None
    )
    if method is None:
        return None, None
    if method == "draft" and args.draft_model is None:
        raise ConfigError("--speculative draft needs --draft-model DIR")
    if method == "ngram" and args.draft_model is not None:
        raise ConfigError("--speculative ngram takes no --draft-model")
    try:
        config = SpeculativeConfig(
            method,
            args.num_speculative_tokens,
            adaptive=not args.fixed_speculative_tokens,
        )
    except ValueError as exc:
        raise ConfigError(f"--num-speculative-tokens: {exc}") from exc
    return method, config


@contextlib.asynccontextmanager
async def _warm_engine(
    driver: AsyncEngine | ProcessEngine | EngineReplicas, backend: EngineBackend
) -> AsyncIterator[object]:
    async with driver:
        await backend.warm_up()
        yield driver


def _weights_version(files: tuple[Path, ...]) -> str:
    """The first 12 hex digits of the SHA-256 of the checkpoint's weights."""
    digest = hashlib.sha256()
    for path in files:
        with path.open("rb") as weights:
            while chunk := weights.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()[:12]


def _rollouts(args: argparse.Namespace, backends: dict[str, Backend]) -> Rollouts | None:
    """The aliases of ``--models-config``, added to ``backends``; ``None`` without it."""
    if args.models_config is None:
        if args.rollout_state is not None:
            raise ConfigError("--rollout-state needs --models-config")
        return None
    # Imported here: the analysis loads scipy (a second of start-up) only when asked for.
    from sluice.rollout.backend import alias_backends
    from sluice.rollout.config import load_models_config
    from sluice.rollout.controller import Rollouts
    from sluice.rollout.store import StateFile

    config = load_models_config(args.models_config)
    state = None if args.rollout_state is None else StateFile(args.rollout_state)
    rollouts = Rollouts(config, state_file=state)
    backends.update(alias_backends(config, backends, rollouts))
    return rollouts


def _workers(
    args: argparse.Namespace, settings: Settings
) -> tuple[dict[str, Backend], list[WorkerPool]]:
    """A backend for each model the ``--worker`` URLs serve, and the pools to run."""
    urls = args.worker or []
    if not args.worker_connect_timeout > 0:
        raise ConfigError("--worker-connect-timeout must be positive")
    described = [describe_worker(url, args.worker_connect_timeout) for url in urls]
    by_model: dict[str, list[WorkerDescription]] = {}
    for description in described:
        by_model.setdefault(description.model, []).append(description)
    # A backstop: the hub itself cuts a stream at its longest duration.
    options = WorkerOptions(deadline_s=settings.max_stream_s + 5.0)
    backends: dict[str, Backend] = {}
    pools = []
    for model, group in by_model.items():
        if len({d.bundle_sha256 for d in group}) > 1:
            listed = ", ".join(d.url for d in group)
            raise ConfigError(f"the workers of {model!r} ({listed}) have different tokenizers")
        first = group[0]
        try:
            files = read_bundle(first.bundle)
        except ValueError as exc:
            raise ConfigError(f"--worker {first.url}: its tokenizer: {exc}") from exc
        pool = WorkerPool(group, options)
        backends[model] = WorkerBackend(
            pool,
            files,
            max_model_len=min(d.max_model_len for d in group),
            eos_token_ids=first.eos_token_ids,
        )
        pools.append(pool)
    return backends, pools


def _upstreams(args: argparse.Namespace) -> list[UpstreamSpec]:
    """The upstreams of ``--upstream-config`` and ``--upstream``."""
    specs = [] if args.upstream_config is None else load_upstream_config(args.upstream_config)
    if args.upstream is not None:
        names = args.upstream_model or list_upstream_models(args.upstream, args.upstream_key)
        specs += [
            UpstreamSpec(
                name,
                args.upstream,
                api_key=args.upstream_key,
                connect_timeout_s=args.upstream_connect_timeout,
                read_timeout_s=args.upstream_read_timeout,
            )
            for name in names
        ]
    elif args.upstream_model:
        raise ConfigError("--upstream-model needs --upstream")
    return specs


def _auth(args: argparse.Namespace) -> tuple[Auth, str | None]:
    """Keys, anonymous mode and the token secret; and what to say about them at start-up.

    Raises :class:`ConfigError` for a server that would be open to anyone who can reach it
    without having been asked to be: no keys, not on loopback, no ``--allow-anonymous``.
    """
    keys = [] if args.auth_config is None else list(load_key_file(args.auth_config, os.environ))
    keys += parse_key_list(os.environ.get("SLUICE_API_KEYS", ""))
    secret_text = args.token_secret or os.environ.get("SLUICE_TOKEN_SECRET")
    if secret_text:
        tokens = ResumeTokens(secret_text.encode("utf-8"), args.token_ttl)
    elif args.redis:  # one secret for every replica, so a token verifies on any of them
        tokens = ResumeTokens(shared_token_secret(args.redis), args.token_ttl)
    else:
        tokens = ResumeTokens.random(args.token_ttl)
    allow_anonymous = args.allow_anonymous
    notice = None
    if allow_anonymous is None:
        allow_anonymous = not keys
        if not keys and not _on_loopback(args):
            raise ConfigError(
                f"no API keys configured and --host {args.host} is not a loopback address: "
                "configure keys (--auth-config FILE or $SLUICE_API_KEYS) or pass "
                "--allow-anonymous to serve anyone who can connect"
            )
    if allow_anonymous:
        if keys:
            notice = "callers without an API key are served as tenant 'anonymous'"
        else:
            notice = (
                "anonymous mode: no API keys configured, every caller is tenant 'anonymous' "
                "(configure keys with --auth-config or $SLUICE_API_KEYS)"
            )
    return Auth(keys, allow_anonymous=allow_anonymous, tokens=tokens), notice


def _on_loopback(args: argparse.Namespace) -> bool:
    """Whether ``--host`` (and the ``--fd`` socket, if any) only accept local connections."""
    if args.host != "localhost" and not _is_loopback_address(args.host):
        return False
    if args.fd is None:
        return True
    try:
        inherited = socket.socket(fileno=os.dup(args.fd))
    except OSError as exc:
        raise ConfigError(f"--fd {args.fd}: {exc.strerror or exc}") from exc
    try:
        if inherited.family not in (socket.AF_INET, socket.AF_INET6):
            return True  # a Unix socket: local by construction
        return _is_loopback_address(inherited.getsockname()[0])
    finally:
        inherited.close()


def _is_loopback_address(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def inherited_listener(fd: int) -> socket.socket:
    """The listening socket ``--fd`` names, as what it is.

    uvicorn opens a descriptor as a Unix socket whatever it is, so the event loop never
    sets ``TCP_NODELAY`` on its TCP connections, and Nagle's algorithm then holds each small
    write for the client's delayed ACK (about 40 ms on Linux). A socket built from the
    descriptor alone reads its own family.
    """
    return socket.socket(fileno=fd)


def serve(args: argparse.Namespace) -> int:
    try:
        settings = _settings(args)
        auth, auth_notice = _auth(args)
    except ConfigError as exc:
        print(f"sluice serve: {exc}", file=sys.stderr)
        return 2
    if args.max_connections is not None and args.max_connections < 1:
        print("sluice serve: --max-connections must be at least 1", file=sys.stderr)
        return 2
    if not args.keep_alive_timeout > 0:
        print("sluice serve: --keep-alive-timeout must be positive", file=sys.stderr)
        return 2
    slo_s, headroom_s = args.ttft_slo, args.ttft_headroom
    if slo_s is not None and not slo_s > 0:
        print("sluice serve: --ttft-slo must be positive", file=sys.stderr)
        return 2
    if not 0 <= headroom_s < (slo_s if slo_s is not None else math.inf):
        print(
            "sluice serve: --ttft-headroom must be at least 0 and under --ttft-slo", file=sys.stderr
        )
        return 2
    log_config = configure_logging(args.log_format, args.log_level, access_log=args.access_log)
    backends: dict[str, Backend] = {}
    resources: list[contextlib.AbstractAsyncContextManager[object]] = []
    try:
        for spec in _upstreams(args):
            backends[spec.name] = spec.backend()
    except ConfigError as exc:
        print(f"sluice serve: {exc}", file=sys.stderr)
        return 2
    try:
        worker_backends, worker_pools = _workers(args, settings)
    except ConfigError as exc:
        print(f"sluice serve: {exc}", file=sys.stderr)
        return 2
    backends.update(worker_backends)
    resources.extend(pool.running() for pool in worker_pools)
    model_name = None
    if args.model is None and not backends and not args.no_model:
        try:
            args.model, model_name = default_model_file(), DEFAULT_MODEL_NAME
        except OSError as exc:
            print(f"sluice serve: {exc}", file=sys.stderr)
            return 2
    if args.model is not None and not args.no_model:
        try:
            name, backend, engine = _embedded_engine(args, model_name)
        except (OSError, ValueError, ConfigError) as exc:
            print(f"sluice serve: --model {args.model}: {exc}", file=sys.stderr)
            return 2
        backends = {name: backend, **backends}  # the engine's model is the default
        resources.append(engine)
    if backends:
        requests = dataclasses.replace(settings.requests, default_model=next(iter(backends)))
        settings = dataclasses.replace(settings, requests=requests)
    try:
        rollouts = _rollouts(args, backends)
    except ConfigError as exc:
        print(f"sluice serve: {exc}", file=sys.stderr)
        return 2
    app = create_app(settings, backends, resources, auth, rollouts)
    listener = None if args.fd is None else inherited_listener(args.fd)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        loop="uvloop",
        http=protocol_class(app.opener, native=args.native_sse),
        # GET /v1/ws (sluice.gateway.websocket): pings keep idle sockets alive; a peer
        # that does not answer one within the send timeout is gone.
        ws=SluiceWebSocketProtocol,
        ws_max_size=app.websockets.limits.max_message_bytes,
        ws_ping_interval=settings.delivery.heartbeat_interval_s,
        ws_ping_timeout=settings.delivery.send_timeout_s,
        ws_per_message_deflate=False,
        lifespan="on",
        log_config=log_config,
        log_level=args.log_level,
        access_log=args.access_log,
        # Read by the protocol (sluice.transports.http1) as the most connections inside a
        # request.
        limit_concurrency=args.max_connections,
        timeout_keep_alive=args.keep_alive_timeout,
        server_header=False,
        backlog=4096,
        timeout_graceful_shutdown=args.shutdown_timeout,
    )
    print(f"Sluice {__version__}: page at http://{args.host}:{args.port}/", flush=True)
    if auth_notice is not None:
        print(f"Sluice: {auth_notice}", flush=True)
    _Server(config, app, args.drain_timeout).run(None if listener is None else [listener])
    # Every stream has ended, the engine thread has stopped and the logs are flushed: skip
    # the interpreter's teardown (seconds with torch loaded), so a supervisor sees the
    # exit as soon as the drain is over.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "bench":
        return loadgen.run(args)
    if args.command == "worker":
        return run_worker(args)
    raise AssertionError(f"unhandled command {args.command!r}")  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
