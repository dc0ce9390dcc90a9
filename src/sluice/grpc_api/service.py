"""``sluice.v1.Streams``: the native streams API over gRPC server-streaming.

Each RPC is the gRPC shell of what the HTTP API does, over the same hub and log:

- ``Generate`` is ``POST /v1/streams`` then ``GET .../events``: the request's fields are
  the JSON body's (validated by the same model, so a bad field is ``INVALID_ARGUMENT``
  naming it), the stream is created and admitted before any message (a refusal is a
  status, never a message: ``RESOURCE_EXHAUSTED`` or ``UNAVAILABLE`` with retry info),
  and its events follow from the first. The initial metadata carries the stream's id and
  resume token (``sluice-stream-id``, ``x-sluice-resume-token``) for a later ``Watch``.
- ``Watch`` reads an existing stream after ``last_event_id`` (``<stream_id>:<n>``, the
  SSE id: a client resumes here what it read over SSE, and the other way round);
  ``Cancel`` is ``POST .../cancel``.

Delivery is the delivery core (:class:`~sluice.transports.delivery.Delivery`) driven by
:func:`~sluice.transports.awaited.pump`: each event one message, written under the send
timeout (gRPC's flow control holds a write until the client takes it; a client that
takes nothing for ``send_timeout_s`` is cut with ``UNAVAILABLE``), a lagging reader's
tokens coalesced, no heartbeats (HTTP/2 keepalive pings are the server's). The client's
deadline bounds the stream, and a cancelled RPC (deadline, client cancel, disconnect)
detaches the reader as a closed SSE connection does: a non-resumable stream is aborted,
its KV blocks freed; a resumable one waits out its grace window.

Auth is the HTTP API's, from the metadata: ``authorization: Bearer <key>`` (or
``x-api-key``), and for ``Watch`` a stream's resume token as ``x-sluice-resume-token``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2, status_pb2

from sluice.errors import BadEventIdError, SluiceError, TenantLimitError
from sluice.events import Error
from sluice.gateway.auth import RESUME_TOKEN_HEADER, Auth, Caller, presented_token
from sluice.gateway.creation import create_native_stream
from sluice.gateway.cursor import open_reader_at
from sluice.gateway.errors import REFUSAL_STATUS, answer_for
from sluice.gateway.settings import Settings
from sluice.grpc_api import streams_pb2 as pb
from sluice.grpc_api.messages import GrpcFrames, split_frames
from sluice.runtime import Runtime
from sluice.streams.hub import Stream
from sluice.streams.ids import is_stream_id, parse_event_id
from sluice.streams.reader import Reader
from sluice.transports.awaited import pump
from sluice.transports.delivery import PING, Delivery, Ending

__all__ = ["SERVICE", "StreamsService"]

SERVICE = pb.DESCRIPTOR.services_by_name["Streams"].full_name  # "sluice.v1.Streams"

# The gRPC status of each HTTP status the API's errors have (gateway.errors.answer_for).
_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    409: grpc.StatusCode.FAILED_PRECONDITION,
    410: grpc.StatusCode.OUT_OF_RANGE,  # resume_gap: the position is no longer retained
    413: grpc.StatusCode.INVALID_ARGUMENT,
    415: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    502: grpc.StatusCode.UNAVAILABLE,
    503: grpc.StatusCode.UNAVAILABLE,
}
# google.rpc.Code has the same numbers as grpc.StatusCode's values.
_RPC_CODES = {code: code.value[0] for code in grpc.StatusCode}

# What the stream's id and resume token are sent as, in Generate's initial metadata.
STREAM_ID_METADATA = "sluice-stream-id"
_RESUME_TOKEN_METADATA = RESUME_TOKEN_HEADER.lower()


class _Refused(Exception):
    """An RPC's answer before any message: a status, its details, optional retry delay."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s


def _refused(exc: SluiceError) -> _Refused:
    answer = answer_for(exc)
    code = _CODES.get(answer.status, grpc.StatusCode.INTERNAL)
    retry = answer.headers.get("Retry-After")
    retry_after_s = float(retry) if retry is not None else None
    if isinstance(exc, TenantLimitError):
        code = grpc.StatusCode.RESOURCE_EXHAUSTED
    return _Refused(code, f"{answer.code}: {answer.message}", retry_after_s)


def _backend_refusal(error: Error, stream: Stream) -> _Refused:
    """The status of a stream whose backend refused the work before it started."""
    status = REFUSAL_STATUS.get(error.type, 500)
    code = _CODES.get(status, grpc.StatusCode.INTERNAL)
    retry_after_s = None
    if status == 503:
        retry_after_s = stream.refusal.retry_after_s if stream.refusal else 1.0
    return _Refused(code, f"{error.type}: {error.message}", retry_after_s)


def _trailers(refused: _Refused) -> tuple[tuple[str, str | bytes], ...]:
    """The rich status (``google.rpc.Status`` with ``RetryInfo``) and the retry pushback
    gRPC's own retry policy reads (gRFC A6), when the client should retry later."""
    if refused.retry_after_s is None:
        return ()
    seconds = max(0.0, refused.retry_after_s)
    delay = duration_pb2.Duration()
    delay.FromNanoseconds(int(seconds * 1e9))
    status = status_pb2.Status(code=_RPC_CODES[refused.code], message=refused.message)
    status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    return (
        ("grpc-status-details-bin", status.SerializeToString()),
        ("grpc-retry-pushback-ms", str(int(seconds * 1000))),
    )


def _headers(context: grpc.aio.ServicerContext[Any, Any]) -> list[tuple[bytes, bytes]]:
    """The call's metadata as the lower-cased header pairs the HTTP API's auth reads."""
    pairs: list[tuple[bytes, bytes]] = []
    for key, value in context.invocation_metadata() or ():
        if isinstance(value, str):
            pairs.append((key.lower().encode("latin-1"), value.encode("latin-1")))
    return pairs


def _create_body(request: pb.GenerateRequest) -> dict[str, object]:
    """The ``POST /v1/streams`` body a request stands for (unset fields left out)."""
    body: dict[str, object] = {"prompt": request.prompt}
    for name in (
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "interval_ms",
        "resumable",
        "grace_s",
        "ignore_eos",
        "user",
    ):
        if request.HasField(name):
            body[name] = getattr(request, name)
    if request.stop:
        body["stop"] = list(request.stop)
    return body


def _identity(data: bytes) -> bytes:
    return data  # frames are serialized once, by GrpcFrames


class StreamsService:
    """The servicer of ``sluice.v1.Streams`` for one runtime."""

    def __init__(self, runtime: Runtime, settings: Settings, auth: Auth) -> None:
        self._runtime = runtime
        self._hub = runtime.hub
        self._settings = settings
        self._auth = auth

    def handler(self) -> grpc.GenericRpcHandler:
        """The handler to register on a ``grpc.aio`` server."""
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Generate": grpc.unary_stream_rpc_method_handler(
                    self.generate,
                    request_deserializer=pb.GenerateRequest.FromString,
                    response_serializer=_identity,
                ),
                "Watch": grpc.unary_stream_rpc_method_handler(
                    self.watch,
                    request_deserializer=pb.WatchRequest.FromString,
                    response_serializer=_identity,
                ),
                "Cancel": grpc.unary_unary_rpc_method_handler(
                    self.cancel,
                    request_deserializer=pb.CancelRequest.FromString,
                    response_serializer=pb.CancelReply.SerializeToString,
                ),
            },
        )

    # ------------------------------------------------------------------ RPCs

    async def generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        try:
            stream = await self._create(request, _headers(context))
        except _Refused as refused:
            await context.abort(refused.code, refused.message, _trailers(refused))
        token = self._auth.tokens.mint(stream.id)
        await context.send_initial_metadata(
            ((STREAM_ID_METADATA, stream.id), (_RESUME_TOKEN_METADATA, token))
        )
        await self._deliver(self._hub.open_reader(stream.id, 0), stream.id, context)

    async def watch(
        self, request: pb.WatchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        try:
            if is_stream_id(request.stream_id):
                await self._hub.attach(request.stream_id)  # a stream another replica runs
            reader = self._open(request, _headers(context))
        except SluiceError as exc:
            refused = _refused(exc)
            await context.abort(refused.code, refused.message, _trailers(refused))
        if reader is not None:
            await self._deliver(reader, request.stream_id, context)

    async def cancel(
        self, request: pb.CancelRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.CancelReply:
        try:
            if is_stream_id(request.stream_id):
                await self._hub.attach(request.stream_id)
            stream = self._find(request.stream_id, self._caller(_headers(context)))
            stream = self._hub.cancel(stream.id)
        except SluiceError as exc:
            refused = _refused(exc)
            await context.abort(refused.code, refused.message, _trailers(refused))
        state = "cancelled" if stream.cancel_requested else stream.state.value
        return pb.CancelReply(stream_id=stream.id, state=state)

    # ------------------------------------------------------------------ internals

    async def _create(
        self, request: pb.GenerateRequest, headers: Sequence[tuple[bytes, bytes]]
    ) -> Stream:
        """The admitted stream of a Generate; raises :class:`_Refused`."""
        if self._runtime.shutdown.is_set():
            raise _Refused(grpc.StatusCode.UNAVAILABLE, "the server is shutting down", 1.0)
        metrics = self._runtime.metrics
        try:
            tenant = self._auth.creator(headers)
        except SluiceError as exc:
            metrics.refused_before_start(exc)
            raise _refused(exc) from exc
        scope = {"headers": list(headers)}
        try:
            created = await create_native_stream(
                self._hub, self._settings, metrics, _create_body(request), scope, tenant
            )
        except SluiceError as exc:  # counted where it was raised
            raise _refused(exc) from exc
        if created.refused is not None:
            raise _backend_refusal(created.refused, created.stream)
        return created.stream

    def _caller(self, headers: Sequence[tuple[bytes, bytes]]) -> Caller:
        return self._auth.caller(headers, presented_token(headers, None))

    def _find(self, stream_id: str, caller: Caller) -> Stream:
        if not is_stream_id(stream_id):
            raise BadEventIdError(f"stream_id: malformed stream id {stream_id[:80]!r}")
        return self._auth.find(self._hub.get, stream_id, caller)

    def _open(
        self, request: pb.WatchRequest, headers: Sequence[tuple[bytes, bytes]]
    ) -> Reader | None:
        """The reader of a Watch, or ``None`` when nothing is left after its position."""
        stream = self._find(request.stream_id, self._caller(headers))
        after_seq = 0
        if request.last_event_id:
            position_stream, after_seq = parse_event_id(request.last_event_id)
            if position_stream != stream.id:
                raise BadEventIdError(
                    f"last_event_id belongs to stream {position_stream}, not {stream.id}"
                )
            self._runtime.metrics.resumes.inc()
        return open_reader_at(self._hub, self._runtime.metrics, stream, after_seq)

    async def _deliver(
        self, reader: Reader, stream_id: str, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        """Write the reader's events until the stream's end (or the call's)."""
        core = Delivery(reader, GrpcFrames(stream_id), self._settings.delivery)

        async def send(body: bytes) -> None:
            if body == PING:
                return  # HTTP/2 keepalive pings keep the call alive
            for message in split_frames(body):
                await context.write(message)

        try:
            await pump(core, send, send_timeout_s=self._settings.delivery.send_timeout_s)
        finally:
            core.close()
        if core.ended is Ending.UNCLEAN:  # the send timeout: the client took nothing
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"the client took nothing for {self._settings.delivery.send_timeout_s} s; "
                "resume with Watch from the last event id",
            )
