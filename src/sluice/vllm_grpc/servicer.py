"""The embedded engine served as ``vllm.grpc.engine.VllmEngine`` (what ``sluice worker`` runs).

The protocol is vLLM's own gRPC engine protocol (:mod:`~sluice.vllm_grpc.proto`): prompts
come in as token ids (or text, which the worker encodes with its tokenizer) and tokens go
out as ids; tokenizing, chat templates and detokenizing are the front's, which gets the
tokenizer from ``GetTokenizer`` (:mod:`~sluice.vllm_grpc.tokenizer_bundle`). What each
method does here:

- ``Generate`` adds the request to the engine (through the
  :class:`~sluice.engine.driver.AsyncEngine`) and, once it is queued, sends the initial
  metadata (``sluice-request-id``), so a client knows it was admitted before its first
  token. Then, streamed, one ``chunk`` per engine output with that step's token ids (the
  outputs that piled up while the client was slow go in one chunk), and after the last
  chunk one ``complete`` with the finish reason (``stop``, ``length``; ``abort`` when
  ``Abort`` ended it), as vLLM's servicer does: the ``complete`` repeats the last chunk's
  ids, which a streaming client has already taken. Not streamed, one ``complete`` with
  every id. The stop that ended a request is named as vLLM names it: a stop string in
  ``matched_stop_str``, a ``stop_token_ids`` entry in ``matched_token_id``, an EOS not at
  all.
- A cancelled RPC (the client's cancel, its deadline, a closed connection) aborts the
  engine request: the abort is queued before anything else can suspend, and the engine
  thread applies it between two steps, freeing the request's KV blocks within a step.
- ``Abort`` aborts live requests by id and answers once the engine has applied it.
- ``GetLoads`` reports the engine's queues and KV cache (one ``SchedulerLoad``, rank 0);
  ``HealthCheck``, ``GetModelInfo`` and ``GetServerInfo`` describe the engine and model.

Refusals are statuses before any message: a full waiting queue ``RESOURCE_EXHAUSTED``
(with ``grpc-retry-pushback-ms``), a bad request ``INVALID_ARGUMENT`` naming the field
(sampling options the engine does not implement are refused, not ignored), a duplicate
live ``request_id`` ``ALREADY_EXISTS``, a stopped engine ``UNAVAILABLE``.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

import grpc

from sluice import __version__
from sluice.engine.driver import (
    AsyncEngine,
    EngineDriverError,
    EngineRequestError,
    RequestStream,
)
from sluice.engine.engine import Engine, RequestOutput
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.scheduler import QueueFullError
from sluice.engine.tokenizer import Tokenizer
from sluice.vllm_grpc.proto import SERVICE, common_pb2
from sluice.vllm_grpc.proto import vllm_engine_pb2 as pb

__all__ = [
    "MAX_REQUEST_ID_CHARS",
    "REQUEST_ID_METADATA",
    "TOKENIZER_CHUNK_BYTES",
    "EngineServicer",
    "ServedModel",
    "engine_params",
]

logger = logging.getLogger(__name__)

# Sent as initial metadata once a request is in the engine's queue.
REQUEST_ID_METADATA: Final = "sluice-request-id"
MAX_REQUEST_ID_CHARS: Final = 256
MAX_ABORT_IDS: Final = 1024
# GetTokenizer's chunks, as vLLM's servicer sends them (under every message size limit).
TOKENIZER_CHUNK_BYTES: Final = 64 << 10
# How long a client is asked to wait when the engine's waiting queue is full.
_QUEUE_FULL_RETRY_MS: Final = 1000

# Sampling options of the protocol the engine does not implement, with the value that
# means "off": anything else is refused, naming the field.
_OFF: Final = {
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "min_tokens": 0,
}


@dataclass(frozen=True, slots=True)
class ServedModel:
    """The model a worker serves: its name, where it came from, its tokenizer and the
    tokenizer bundle ``GetTokenizer`` streams."""

    name: str
    path: str
    model_type: str
    architecture: str
    tokenizer: Tokenizer
    bundle: bytes


def engine_params(
    proto: pb.SamplingParams, num_prompt_tokens: int, max_model_len: int
) -> SamplingParams:
    """The engine's sampling parameters of a request's; :class:`ValueError` for a value
    the engine cannot honour, naming the field (vLLM's defaults where a field is unset)."""
    for name, off in _OFF.items():
        if getattr(proto, name) != off:
            raise ValueError(f"sampling_params.{name}: not supported by this engine")
    if proto.repetition_penalty not in (0.0, 1.0):
        raise ValueError("sampling_params.repetition_penalty: not supported by this engine")
    if proto.n > 1:
        raise ValueError("sampling_params.n: one sample per request only")
    if proto.logit_bias:
        raise ValueError("sampling_params.logit_bias: not supported by this engine")
    if proto.WhichOneof("constraint") is not None:
        raise ValueError("sampling_params.constraint: the engine does not constrain output")
    if proto.HasField("prompt_logprobs"):
        raise ValueError("sampling_params.prompt_logprobs: not supported by this engine")
    if proto.HasField("truncate_prompt_tokens"):
        raise ValueError("sampling_params.truncate_prompt_tokens: not supported")
    if proto.HasField("logprobs") and proto.logprobs != 0:
        raise ValueError("sampling_params.logprobs: only the sampled token's (0) is reported")
    if proto.HasField("max_tokens"):
        max_tokens = proto.max_tokens
    else:  # vLLM's default: the rest of the context
        max_tokens = max(1, max_model_len - num_prompt_tokens)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=proto.temperature if proto.HasField("temperature") else 1.0,
        top_k=proto.top_k,
        top_p=proto.top_p if proto.top_p != 0.0 else 1.0,
        seed=proto.seed if proto.HasField("seed") else None,
        stop=tuple(proto.stop),
        stop_token_ids=tuple(proto.stop_token_ids),
        ignore_eos=proto.ignore_eos,
        logprobs=proto.HasField("logprobs"),
    )


def _load_snapshot(engine: Engine) -> tuple[int, int, int, int]:
    """Running and waiting requests, used and total KV blocks (on the engine thread)."""
    blocks = engine.block_manager_stats()
    return engine.num_running, engine.num_waiting, blocks.num_used_blocks, blocks.num_blocks


def _chunk(outputs: Sequence[RequestOutput]) -> pb.GenerateResponse:
    ids = [token for output in outputs for token in output.new_token_ids]
    last = outputs[-1]
    chunk = pb.GenerateStreamChunk(
        token_ids=ids,
        prompt_tokens=last.num_prompt_tokens,
        completion_tokens=len(ids),
        cached_tokens=last.num_cached_tokens,
    )
    if last.logprobs is not None:
        chunk.output_logprobs.token_ids.extend(ids)
        chunk.output_logprobs.token_logprobs.extend(
            value for output in outputs for value in output.logprobs or ()
        )
    return pb.GenerateResponse(chunk=chunk)


def _complete(
    ids: Sequence[int],
    reason: str,
    last: RequestOutput | None,
    params: SamplingParams,
    num_prompt_tokens: int,
) -> pb.GenerateResponse:
    complete = pb.GenerateComplete(
        output_ids=ids,
        finish_reason=reason,
        prompt_tokens=num_prompt_tokens,
        completion_tokens=len(ids),
        cached_tokens=0 if last is None else last.num_cached_tokens,
    )
    if last is not None and last.stop_sequence is not None:
        complete.matched_stop_str = last.stop_sequence
    elif reason == "stop" and ids and ids[-1] in params.stop_token_ids:
        complete.matched_token_id = ids[-1]
    return pb.GenerateResponse(complete=complete)


class EngineServicer:
    """``VllmEngine`` over one started :class:`~sluice.engine.driver.AsyncEngine`."""

    def __init__(self, driver: AsyncEngine, model: ServedModel) -> None:
        self._driver = driver
        self._model = model
        self._live: dict[str, int] = {}  # request_id -> the engine's id, while generating
        self._started = time.time()
        self._last_received = 0.0
        self._bundle_sha256 = hashlib.sha256(model.bundle).hexdigest()

    def handler(self) -> grpc.GenericRpcHandler:
        """The handler to register on a ``grpc.aio`` server."""
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Generate": grpc.unary_stream_rpc_method_handler(
                    self.generate,
                    request_deserializer=pb.GenerateRequest.FromString,
                    response_serializer=pb.GenerateResponse.SerializeToString,
                ),
                "Abort": grpc.unary_unary_rpc_method_handler(
                    self.abort,
                    request_deserializer=pb.AbortRequest.FromString,
                    response_serializer=pb.AbortResponse.SerializeToString,
                ),
                "HealthCheck": grpc.unary_unary_rpc_method_handler(
                    self.health_check,
                    request_deserializer=pb.HealthCheckRequest.FromString,
                    response_serializer=pb.HealthCheckResponse.SerializeToString,
                ),
                "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                    self.get_model_info,
                    request_deserializer=pb.GetModelInfoRequest.FromString,
                    response_serializer=pb.GetModelInfoResponse.SerializeToString,
                ),
                "GetServerInfo": grpc.unary_unary_rpc_method_handler(
                    self.get_server_info,
                    request_deserializer=pb.GetServerInfoRequest.FromString,
                    response_serializer=pb.GetServerInfoResponse.SerializeToString,
                ),
                "GetLoads": grpc.unary_unary_rpc_method_handler(
                    self.get_loads,
                    request_deserializer=pb.GetLoadsRequest.FromString,
                    response_serializer=pb.GetLoadsResponse.SerializeToString,
                ),
                "GetTokenizer": grpc.unary_stream_rpc_method_handler(
                    self.get_tokenizer,
                    request_deserializer=common_pb2.GetTokenizerRequest.FromString,
                    response_serializer=common_pb2.GetTokenizerChunk.SerializeToString,
                ),
            },
        )

    @property
    def num_live(self) -> int:
        """Requests being generated now."""
        return len(self._live)

    # ------------------------------------------------------------------ Generate

    def _prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("input")
        if kind == "tokenized":
            return list(request.tokenized.input_ids)
        if kind == "text":
            return self._model.tokenizer.encode(request.text)
        raise ValueError("input: a request needs tokenized input or text")

    async def generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        self._last_received = time.time()
        request_id = request.request_id or f"sluice-{secrets.token_hex(12)}"
        if len(request_id) > MAX_REQUEST_ID_CHARS:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request_id: at most {MAX_REQUEST_ID_CHARS} characters",
            )
        if request_id in self._live:
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS, f"request_id {request_id!r} is already live"
            )
        for name in ("mm_inputs", "media_refs", "kv_transfer_params"):
            if request.HasField(name):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: not supported")
        config = self._driver.config
        try:
            prompt_ids = self._prompt_ids(request)
            params = engine_params(request.sampling_params, len(prompt_ids), config.max_model_len)
            stream = await self._driver.add_request(prompt_ids, params)
        except QueueFullError as exc:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the engine's waiting queue is full: {exc}",
                (("grpc-retry-pushback-ms", str(_QUEUE_FULL_RETRY_MS)),),
            )
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineDriverError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        self._live[request_id] = stream.request_id
        done = False  # the engine is through with the request (finished, failed, aborted)
        try:
            await context.send_initial_metadata(((REQUEST_ID_METADATA, request_id),))
            async for response in self._responses(stream, params, len(prompt_ids), request.stream):
                await context.write(response)
            done = True
        except EngineRequestError as exc:
            done = True
            await context.abort(grpc.StatusCode.INTERNAL, str(exc))
        except EngineDriverError as exc:
            done = True
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        finally:
            del self._live[request_id]
            if not done:  # cancelled, its deadline passed, or its write failed
                self._driver.abort_nowait(stream.request_id)

    async def _responses(
        self,
        stream: RequestStream,
        params: SamplingParams,
        num_prompt_tokens: int,
        streamed: bool,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """The messages of one request's outputs (see the module)."""
        ids: list[int] = []  # every id, for a request that is not streamed
        last: RequestOutput | None = None
        async for output in stream:
            outputs = [output, *stream.take_ready()]
            last = outputs[-1]
            if streamed:
                yield _chunk(outputs)
            else:
                ids.extend(token for o in outputs for token in o.new_token_ids)
            if last.finished:
                final_ids = [token for o in outputs for token in o.new_token_ids]
                reason = last.finish_reason or "stop"
                yield _complete(
                    final_ids if streamed else ids, reason, last, params, num_prompt_tokens
                )
                return
        # The stream ended without a finished output: Abort ended it.
        yield _complete([] if streamed else ids, "abort", last, params, num_prompt_tokens)

    # ------------------------------------------------------------------ the rest

    async def abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.AbortResponse:
        if len(request.request_ids) > MAX_ABORT_IDS:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"request_ids: at most {MAX_ABORT_IDS}"
            )
        for request_id in request.request_ids:
            engine_id = self._live.get(request_id)
            if engine_id is not None:
                await self._driver.abort(engine_id)
        return pb.AbortResponse()

    async def health_check(
        self, request: pb.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.HealthCheckResponse:
        if self._driver.is_running:
            return pb.HealthCheckResponse(healthy=True, message="Health")
        return pb.HealthCheckResponse(healthy=False, message="the engine has stopped")

    async def get_model_info(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetModelInfoResponse:
        model, config = self._model, self._driver.config
        tokenizer = model.tokenizer
        return pb.GetModelInfoResponse(
            model_path=model.path,
            is_generation=True,
            max_context_length=config.max_model_len,
            vocab_size=tokenizer.vocab_size,
            served_model_name=model.name,
            model_type=model.model_type,
            architectures=[model.architecture],
            eos_token_ids=list(tokenizer.eos_token_ids),
            pad_token_id=-1,
            bos_token_id=-1 if tokenizer.bos_token_id is None else tokenizer.bos_token_id,
            max_req_input_len=config.max_model_len - 1,
        )

    async def get_server_info(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetServerInfoResponse:
        config = self._driver.config
        return pb.GetServerInfoResponse(
            active_requests=len(self._live),
            is_paused=False,
            last_receive_timestamp=self._last_received,
            uptime_seconds=time.time() - self._started,
            server_type="sluice",
            data_parallel_size=1,
            kv_cache_dtype="auto",
            block_size=config.block_size,
            model_dtype="torch.float32",
            max_num_seqs=config.max_num_seqs,
        )

    async def get_loads(
        self, request: pb.GetLoadsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetLoadsResponse:
        try:
            running, waiting, used_blocks, num_blocks = await self._driver.call(_load_snapshot)
        except EngineDriverError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        config = self._driver.config
        load = pb.SchedulerLoad(
            dp_rank=0,
            num_running_reqs=running,
            num_waiting_reqs=waiting,
            num_total_reqs=running + waiting,
            num_used_tokens=used_blocks * config.block_size,
            max_total_num_tokens=num_blocks * config.block_size,
            token_usage=used_blocks / num_blocks,
            utilization=running / config.max_num_seqs,
            max_running_requests=config.max_num_seqs,
        )
        now = datetime.datetime.now(datetime.UTC).isoformat()
        return pb.GetLoadsResponse(
            timestamp=now, version=f"sluice {__version__}", dp_rank_count=1, loads=[load]
        )

    async def get_tokenizer(
        self, request: common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        data = self._model.bundle
        for start in range(0, len(data), TOKENIZER_CHUNK_BYTES):
            end = min(start + TOKENIZER_CHUNK_BYTES, len(data))
            sha256 = self._bundle_sha256 if end == len(data) else ""
            await context.write(common_pb2.GetTokenizerChunk(data=data[start:end], sha256=sha256))
