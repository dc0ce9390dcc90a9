"""The ``worker`` backend: generations streamed from engine workers over vLLM's gRPC protocol.

``sluice serve --worker grpc://HOST:PORT`` (repeatable) serves each model its workers
serve (``sluice worker``, or a real ``vllm serve --grpc``: the protocol is vLLM's,
:mod:`sluice.vllm_grpc.proto`) as a :class:`WorkerBackend`, behind the same seam as the
in-process engine, so every dialect and transport works unchanged. "Internal stream, edge
stream": the gateway's producer holds one ``Generate`` stream per generation.

The protocol carries token ids, so the gateway does what the engine does around its steps,
with the worker's own tokenizer and chat template (``GetTokenizer``,
:mod:`sluice.vllm_grpc.tokenizer_bundle`): it renders and encodes the prompt
(:class:`~sluice.backends.prompt.PromptPreparer`: an oversized prompt is refused before it
is encoded), sends the ids, and detokenizes what comes back with the engine's
:class:`~sluice.engine.detokenizer.IncrementalDetokenizer` and the engine's rules (an EOS
token ends the text unless ``ignore_eos``; stop strings are held back and cut), so at
greedy the text is the in-process engine's. Stop strings also go to the worker, which stops
at the same token and frees the sequence's blocks. Tool calls are read as the engine
backend reads them (:mod:`sluice.backends.engine_tools`).

``start()`` places the request on the least loaded worker (:mod:`sluice.backends.worker_pool`)
and returns once the worker has admitted it (a Sluice worker sends its initial metadata
when the request is in its engine's queue; another server's come with its first token). A
worker that cannot take it (down, not connecting within the connect timeout, or its queue
full) is left for the next one; when none can, the request is refused with
:class:`~sluice.errors.CapacityError` (``503`` + ``Retry-After``), at once: nothing waits
on a dead worker. A worker's refusal of the request itself (``INVALID_ARGUMENT``) is a
:class:`~sluice.errors.BadRequestError`; a stream that breaks midway a retryable
:class:`~sluice.errors.BackendError`.

``abort()`` cancels the RPC (the worker aborts the engine request, freeing its KV blocks
within a step) and calls ``Abort`` with the request's id, which answers once the worker's
engine has applied it: so, like the engine backend's, it returns when the blocks are free,
and its time goes to the abort observer. Each ``Generate`` carries the pool's deadline,
which the worker enforces the same way.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from sluice.backends.base import Delta, GenerationRequest
from sluice.backends.chat import SIMPLE_TEMPLATE, ChatTemplate
from sluice.backends.engine_tools import read_tool_calls, tools_to_show
from sluice.backends.prompt import PromptPreparer
from sluice.backends.tool_call_parser import HermesToolCallParser
from sluice.backends.worker_pool import Worker, WorkerPool
from sluice.engine.detokenizer import IncrementalDetokenizer
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.tokenizer import Tokenizer
from sluice.errors import BackendError, BadRequestError, CapacityError
from sluice.events import FinishReason, TextDelta, ToolCallDelta, Usage
from sluice.vllm_grpc.proto import vllm_engine_pb2 as pb
from sluice.vllm_grpc.tokenizer_bundle import ModelFiles

__all__ = ["WorkerBackend", "WorkerGeneration"]

logger = logging.getLogger(__name__)

_FINISH_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}
# The protocol's seed is an int32.
_MAX_SEED = 2**31 - 1
# Status codes after which another worker may take the request.
_NEXT_WORKER = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED}
)

AbortObserver = Callable[[float], None]


def _proto_params(request: GenerationRequest, max_tokens: int) -> pb.SamplingParams:
    """The request's sampling options in the protocol's terms, checked as the engine
    checks them (:class:`ValueError` naming what is wrong)."""
    params = SamplingParams(max_tokens=max_tokens)
    changes: dict[str, object] = {}
    for name in ("temperature", "top_p", "top_k", "seed"):
        value = getattr(request, name)
        if value is not None:
            changes[name] = value
    params = dataclasses.replace(params, **changes)  # type: ignore[arg-type]
    if params.seed is not None and params.seed > _MAX_SEED:
        raise ValueError(f"seed must be at most {_MAX_SEED} for a model served by a worker")
    proto = pb.SamplingParams(
        max_tokens=max_tokens,
        top_k=params.top_k,
        top_p=params.top_p,
        stop=list(request.stop),
        ignore_eos=request.ignore_eos,
        skip_special_tokens=True,
    )
    if request.temperature is not None:
        proto.temperature = params.temperature
    if params.seed is not None:
        proto.seed = params.seed
    return proto


class WorkerGeneration:
    """One ``Generate`` stream on a worker, started by ``start()``; iterable once."""

    def __init__(self, backend: WorkerBackend, request: GenerationRequest, max_tokens: int) -> None:
        self._backend = backend
        self._request = request
        self._max_tokens = max_tokens
        self._request_id = f"sluice-{secrets.token_hex(12)}"
        self._call: grpc.aio.UnaryStreamCall[Any, pb.GenerateResponse] | None = None
        self._worker: Worker | None = None
        self._counted = False  # counted in its worker's num_live
        self._iterated = False
        self._aborted = False
        self._finished = False  # the worker is through with it
        self._num_prompt_tokens = 0
        self._num_completion_tokens = 0
        self._num_cached_tokens = 0
        tokenizer = backend.files.tokenizer
        self._detokenizer = IncrementalDetokenizer(request.stop)
        self._token_bytes = tokenizer.token_bytes
        self._eos = frozenset(() if request.ignore_eos else backend.eos_token_ids)
        self._parser: HermesToolCallParser | None = None

    @property
    def worker_url(self) -> str | None:
        """The worker it runs on, once started."""
        return None if self._worker is None else self._worker.url

    async def start(self) -> None:
        """Place the request on a worker and wait until it is admitted (see the module)."""
        if self._call is not None or self._aborted:
            return
        backend = self._backend
        try:
            tools = tools_to_show(self._request, renders_tools=backend.prompts.renders_tools)
            params = _proto_params(self._request, self._max_tokens)
            prompt_ids = await backend.prompts.prompt_ids(
                self._request, self._max_tokens, tools=tools
            )
        except ValueError as exc:
            raise BadRequestError(str(exc)) from exc
        self._num_prompt_tokens = len(prompt_ids)
        self._parser = HermesToolCallParser() if tools else None
        message = pb.GenerateRequest(
            request_id=self._request_id,
            tokenized=pb.TokenizedInput(input_ids=prompt_ids),
            sampling_params=params,
            stream=True,
        )
        pool = backend.pool
        why = "no worker is up"
        for worker in pool.ranked():
            if self._abort_requested():
                return
            if not await pool.connect(worker):
                why = f"{worker.url} did not connect"
                continue
            call = worker.client.generate(message, timeout=pool.options.deadline_s)
            worker.num_started += 1
            try:
                await call.initial_metadata()
                code = await call.code() if call.done() else grpc.StatusCode.OK
            except BaseException:
                call.cancel()
                worker.num_ended += 1
                raise
            if code is grpc.StatusCode.OK:
                self._call, self._worker, self._counted = call, worker, True
                if self._abort_requested():  # abort() ran while the worker was admitting it
                    self._finished = True
                    self._leave()
                    await self._abort_on_worker()
                return
            worker.num_ended += 1
            details = await call.details()
            if code is grpc.StatusCode.INVALID_ARGUMENT:
                raise BadRequestError(f"the worker refused the request: {details}")
            if code not in _NEXT_WORKER:
                raise BackendError(f"worker {worker.url} failed: {code.name}: {details}")
            if code is grpc.StatusCode.UNAVAILABLE:
                pool.mark_down(worker, details or code.name)
            why = f"{worker.url}: {code.name}: {details}"
        raise CapacityError(
            f"no worker of {pool.model!r} can take the request now ({why})",
            retry_after_s=pool.options.retry_after_s,
            reason="worker_unavailable",
        )

    def __aiter__(self) -> AsyncIterator[Delta]:
        if self._iterated:
            raise RuntimeError("a WorkerGeneration can be iterated only once")
        self._iterated = True
        return self._run()

    async def _run(self) -> AsyncIterator[Delta]:
        await self.start()
        call = self._call
        if call is None or self._finished:  # aborted before or while starting
            return
        try:
            async for response in call:
                kind = response.WhichOneof("response")
                if kind == "chunk":
                    yield self._read(response.chunk)
                elif kind == "complete":
                    self._finished = True
                    yield self._end(response.complete)
                    return
            self._finished = True
            raise BackendError(
                f"worker {self.worker_url} ended the stream without completing it",
                retryable=True,
            )
        except grpc.aio.AioRpcError as exc:
            self._finished = True
            retryable = exc.code() in _NEXT_WORKER or exc.code() is grpc.StatusCode.INTERNAL
            raise BackendError(
                f"worker {self.worker_url} failed mid-stream: {exc.code().name}: {exc.details()}",
                retryable=retryable,
            ) from exc
        finally:
            self._leave()
            if not self._finished:  # cancelled or abandoned: free the worker's blocks
                self._finished = True
                await self._abort_on_worker()

    def _read(self, chunk: pb.GenerateStreamChunk) -> Delta:
        """One chunk's tokens as text, by the engine's rules (see the module)."""
        self._num_cached_tokens = chunk.cached_tokens
        self._num_completion_tokens += len(chunk.token_ids)
        texts: list[str] = []
        detokenizer = self._detokenizer
        for token in chunk.token_ids:
            if token in self._eos:
                text = detokenizer.flush()
            else:
                text = detokenizer.push(self._token_bytes(token))
            if text:
                texts.append(text)
        if self._parser is not None:
            return read_tool_calls(self._parser, "".join(texts), None, finished=False)
        return Delta([TextDelta(text) for text in texts])

    def _end(self, complete: pb.GenerateComplete) -> Delta:
        reason = _FINISH_REASONS.get(complete.finish_reason)
        if reason is None:
            raise BackendError(
                f"worker {self.worker_url} ended the request: {complete.finish_reason or '?'}",
                retryable=complete.finish_reason == "abort",
            )
        text = self._detokenizer.flush()
        stop = self._detokenizer.stop
        if self._parser is not None:
            return read_tool_calls(self._parser, text, reason, finished=True, stop_sequence=stop)
        events: list[TextDelta | ToolCallDelta] = [TextDelta(text)] if text else []
        return Delta(events, reason, stop)

    def _abort_requested(self) -> bool:
        return self._aborted

    def _leave(self) -> None:
        """No longer one of this gateway's streams on its worker (once)."""
        if self._worker is not None and self._counted:
            self._counted = False
            self._worker.num_ended += 1

    async def abort(self) -> None:
        """Cancel the RPC and return once the worker has freed the request's blocks
        (idempotent; safe before the start and after the end)."""
        self._aborted = True
        if self._call is not None and not self._finished:
            self._finished = True
            self._leave()
            await self._abort_on_worker()

    async def _abort_on_worker(self) -> None:
        """Cancel the call, then ``Abort`` the request id: answered once the worker's
        engine applied an abort (the cancel's or this one), the blocks are free."""
        call, worker = self._call, self._worker
        if call is not None:
            call.cancel()
        if worker is None:
            return
        asked = time.monotonic()
        try:
            await worker.client.abort(
                pb.AbortRequest(request_ids=[self._request_id]),
                timeout=self._backend.pool.options.rpc_timeout_s,
            )
        except grpc.aio.AioRpcError as exc:  # the cancel frees them all the same
            logger.info("worker %s: Abort failed: %s", worker.url, exc.code().name)
            return
        observer = self._backend.abort_observer
        if observer is not None:
            observer(time.monotonic() - asked)

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self._num_prompt_tokens,
            completion_tokens=self._num_completion_tokens,
            cached_tokens=self._num_cached_tokens,
        )


class WorkerBackend:
    """Serves one model name from a :class:`~sluice.backends.worker_pool.WorkerPool`."""

    def __init__(
        self,
        pool: WorkerPool,
        files: ModelFiles,
        *,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
        default_max_tokens: int = 128,
        version: str = "",
    ) -> None:
        if default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be at least 1, got {default_max_tokens}")
        self.pool = pool
        self.files = files
        self.eos_token_ids = eos_token_ids or files.tokenizer.eos_token_ids
        self._default_max_tokens = default_max_tokens
        template = files.chat_template
        chat = ChatTemplate(
            SIMPLE_TEMPLATE if template is None else template,
            bos_token=files.bos_token,
            eos_token=files.eos_token,
        )
        tokenizer: Tokenizer = files.tokenizer
        self.prompts = PromptPreparer(tokenizer, chat, max_model_len)
        self.version = version
        self.abort_observer: AbortObserver | None = None

    def set_abort_observer(self, observer: AbortObserver | None) -> None:
        """Tell ``observer`` the seconds each aborted request took to free its KV blocks on
        its worker (the app points it at its metrics)."""
        self.abort_observer = observer

    @property
    def model(self) -> str:
        return self.pool.model

    def generate(self, request: GenerationRequest) -> WorkerGeneration:
        max_tokens = self._default_max_tokens if request.max_tokens is None else request.max_tokens
        return WorkerGeneration(self, request, max_tokens)

    async def stats(self) -> dict[str, int]:
        """The workers' queues and KV caches now, summed (for ``/readyz`` and metrics)."""
        loads = await self.pool.poll_all()
        stats = {"workers": len(loads), "workers_up": 0, "running": 0, "waiting": 0}
        stats |= {"kv_blocks": 0, "kv_blocks_used": 0}
        for worker, load in zip(self.pool.workers, loads, strict=True):
            if load is None:
                continue
            block_size = worker.description.block_size
            stats["workers_up"] += 1
            stats["running"] += load.num_running
            stats["waiting"] += load.num_waiting
            stats["kv_blocks"] += load.max_total_tokens // block_size
            stats["kv_blocks_used"] += load.num_used_tokens // block_size
        return stats

    async def aclose(self) -> None:
        """Stop the prompt workers; the pool's channels belong to whoever runs it."""
        self.prompts.close()
