"""Typed calls of ``VllmEngine`` on a channel, and what a worker says about itself.

:class:`EngineClient` holds one multi-callable per method the gateway uses, on a
``grpc.aio`` channel. :func:`describe_worker` asks a worker, with a blocking channel (it
runs at start-up, before the server's event loop), for its model, server facts and
tokenizer bundle, waiting for it to come up for at most the timeout given.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import grpc

from sluice.errors import ConfigError
from sluice.vllm_grpc.proto import common_pb2, method_path
from sluice.vllm_grpc.proto import vllm_engine_pb2 as pb
from sluice.vllm_grpc.tokenizer_bundle import MAX_BUNDLE_BYTES

__all__ = ["EngineClient", "WorkerDescription", "describe_worker", "parse_worker_url"]


class EngineClient:
    """The methods of ``VllmEngine`` the gateway calls, on one ``grpc.aio`` channel."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.generate = channel.unary_stream(
            method_path("Generate"),
            request_serializer=pb.GenerateRequest.SerializeToString,
            response_deserializer=pb.GenerateResponse.FromString,
        )
        self.abort = channel.unary_unary(
            method_path("Abort"),
            request_serializer=pb.AbortRequest.SerializeToString,
            response_deserializer=pb.AbortResponse.FromString,
        )
        self.get_loads = channel.unary_unary(
            method_path("GetLoads"),
            request_serializer=pb.GetLoadsRequest.SerializeToString,
            response_deserializer=pb.GetLoadsResponse.FromString,
        )
        self.get_model_info = channel.unary_unary(
            method_path("GetModelInfo"),
            request_serializer=pb.GetModelInfoRequest.SerializeToString,
            response_deserializer=pb.GetModelInfoResponse.FromString,
        )


def parse_worker_url(url: str) -> str:
    """The gRPC target (``host:port``) of a ``grpc://HOST:PORT`` URL; :class:`ConfigError`
    for anything else (TLS, ``grpcs://``, is not supported yet)."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme != "grpc":
        raise ConfigError(f"--worker {url!r}: expected grpc://HOST:PORT")
    host, colon, port = rest.rstrip("/").rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--worker {url!r}: expected grpc://HOST:PORT")
    return f"{host}:{port}"


@dataclass(frozen=True, slots=True)
class WorkerDescription:
    """What a worker said at start-up: its model, limits and tokenizer bundle."""

    url: str
    target: str
    model: str
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    block_size: int
    server_type: str
    bundle: bytes
    bundle_sha256: str


def describe_worker(url: str, timeout_s: float) -> WorkerDescription:
    """Ask the worker at ``url`` about itself, waiting up to ``timeout_s`` for it to come
    up; :class:`ConfigError` naming the worker if it does not answer or answers nonsense."""
    target = parse_worker_url(url)
    with grpc.insecure_channel(target) as channel:
        info_call = channel.unary_unary(
            method_path("GetModelInfo"),
            request_serializer=pb.GetModelInfoRequest.SerializeToString,
            response_deserializer=pb.GetModelInfoResponse.FromString,
        )
        server_call = channel.unary_unary(
            method_path("GetServerInfo"),
            request_serializer=pb.GetServerInfoRequest.SerializeToString,
            response_deserializer=pb.GetServerInfoResponse.FromString,
        )
        tokenizer_call = channel.unary_stream(
            method_path("GetTokenizer"),
            request_serializer=common_pb2.GetTokenizerRequest.SerializeToString,
            response_deserializer=common_pb2.GetTokenizerChunk.FromString,
        )
        try:
            info = info_call(pb.GetModelInfoRequest(), timeout=timeout_s, wait_for_ready=True)
            server = server_call(pb.GetServerInfoRequest(), timeout=timeout_s)
            parts: list[bytes] = []
            size, sha256 = 0, ""
            for chunk in tokenizer_call(common_pb2.GetTokenizerRequest(), timeout=timeout_s):
                size += len(chunk.data)
                if size > MAX_BUNDLE_BYTES:
                    raise ConfigError(f"--worker {url}: its tokenizer is over {MAX_BUNDLE_BYTES} B")
                parts.append(chunk.data)
                sha256 = chunk.sha256 or sha256
        except grpc.RpcError as exc:  # the raised error is also a grpc.Call
            code, details = getattr(exc, "code", None), getattr(exc, "details", None)
            status = code().name if callable(code) else "error"
            detail = details() if callable(details) else str(exc)
            raise ConfigError(
                f"--worker {url}: no answer within {timeout_s:g} s ({status}: {detail})"
            ) from exc
    bundle = b"".join(parts)
    if sha256 and hashlib.sha256(bundle).hexdigest() != sha256:
        raise ConfigError(f"--worker {url}: its tokenizer bundle does not match its SHA-256")
    if not info.served_model_name or info.max_context_length < 2:
        raise ConfigError(f"--worker {url}: GetModelInfo names no model or context length")
    return WorkerDescription(
        url=url,
        target=target,
        model=info.served_model_name,
        max_model_len=info.max_context_length,
        eos_token_ids=tuple(info.eos_token_ids),
        block_size=server.block_size or 16,
        server_type=server.server_type,
        bundle=bundle,
        bundle_sha256=sha256 or hashlib.sha256(bundle).hexdigest(),
    )
