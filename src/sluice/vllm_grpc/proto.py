"""The messages and method paths of ``vllm.grpc.engine.VllmEngine``, from ``smg-grpc-proto``.

The package (pinned in ``pyproject.toml``) ships the protocol's ``.proto`` files and the
code ``protoc`` generated from them, typed by ``.pyi`` files. Only its message modules are
used here: the service is registered (:mod:`~sluice.vllm_grpc.servicer`) and called
(:mod:`sluice.backends.worker`) through grpc's generic handlers and multi-callables by the
method paths its descriptor names, so the package's untyped ``_pb2_grpc`` module is not
needed. Nothing of the protocol is copied into this repository.

The methods Sluice serves: ``Generate`` (server-streaming), ``Abort``, ``HealthCheck``,
``GetModelInfo``, ``GetServerInfo``, ``GetLoads`` and ``GetTokenizer`` (server-streaming);
the others (``Embed``, ``FlushCache``, the profiler, ``SubscribeKvEvents``) answer
``UNIMPLEMENTED``.
"""

from __future__ import annotations

from typing import Final

from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2

__all__ = ["SERVICE", "common_pb2", "method_path", "vllm_engine_pb2"]

SERVICE: Final = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name


def method_path(name: str) -> str:
    """The HTTP/2 path of method ``name`` of the service (``/vllm.grpc.engine.VllmEngine/...``)."""
    if name not in vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"].methods_by_name:
        raise ValueError(f"VllmEngine has no method {name!r}")
    return f"/{SERVICE}/{name}"
