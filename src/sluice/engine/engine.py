"""The inference engine: requests in, token and text deltas out, one step at a time.

One :meth:`Engine.step` is three calls, in the manner of nano-vllm::

    batch = scheduler.schedule()           # which tokens of which sequences run now
    logits = model_runner.run(batch)       # next-token logits of each sampling item
    scheduler.postprocess(batch, sampled, finished)

Between the last two, the engine samples each sampling item's token, feeds its bytes to the
request's :class:`~sluice.engine.detokenizer.IncrementalDetokenizer` and decides which
requests end with it:

- ``"stop"``: the token is EOS (unless ``ignore_eos``) or one of ``stop_token_ids`` (its
  text is not emitted), or the released text reached a stop string (text up to it only);
- ``"length"``: ``max_tokens`` completion tokens, or ``max_model_len`` tokens in all.

With speculative decoding (``speculation``), a decoding request may gain several tokens
in one step: a proposer drafts up to ``k`` (:mod:`~sluice.engine.proposer`), the model
scores them in the same pass (:meth:`~sluice.engine.model_runner.ModelRunner.verify`) and
:mod:`~sluice.engine.acceptance` keeps what the model would have produced itself. Those
tokens are checked one by one as above, so a request that ends at one (EOS, a stop string,
a limit) drops the rest: the output is the one it would be without speculation.

Faults are contained where they happen. A request whose own row fails (its logits cannot be
sampled, or detokenizing or checking its token raises) is aborted alone, its blocks freed in
the same step, and gets one finished output with ``error`` set; the rest of the batch goes
on. Only a fault of the whole step (the forward pass) aborts every request of the batch.

Request ids are the scheduler's sequence ids. Nothing here runs on its own: the caller (a
server loop) calls :meth:`Engine.step` while :meth:`Engine.has_unfinished_requests`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping

import torch

from sluice.engine.block_manager import BlockManager, BlockManagerStats
from sluice.engine.detokenizer import IncrementalDetokenizer
from sluice.engine.model_runner import ModelRunner, PagedModel, StepLogits
from sluice.engine.outputs import EngineConfig, FinishReason, RequestOutput, StepStats
from sluice.engine.proposer import Draft, DraftRequest
from sluice.engine.sampler import Sampler, SamplingError
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.scheduler import ScheduledBatch, Scheduler
from sluice.engine.sequence import Sequence
from sluice.engine.speculative import SpecDecodeStats, SpeculativeConfig
from sluice.engine.speculator import Speculator
from sluice.engine.threads import ThreadGovernor

__all__ = [
    "REQUEST_FAILED_MESSAGE",
    "Engine",
    "EngineConfig",
    "FinishReason",
    "RequestOutput",
    "StepStats",
]

logger = logging.getLogger(__name__)


# What a request's client is told when its row failed for a reason the engine did not
# foresee (a bug): the traceback goes to the server log, never to the client.
REQUEST_FAILED_MESSAGE = "the engine failed while generating this request"


class _Request:
    """The engine's bookkeeping for one live request."""

    __slots__ = ("detokenizer", "num_cached_tokens", "params", "seq")

    def __init__(self, seq: Sequence, params: SamplingParams) -> None:
        self.seq = seq
        self.params = params
        self.detokenizer = IncrementalDetokenizer(params.stop)
        self.num_cached_tokens: int | None = None  # prompt tokens from the prefix cache


# One request's verify: its emitted tokens and their logprobs, or its exception.
_Verified = tuple[list[int], list[float]] | Exception


def _one_pass(
    request_ids: list[int], verify: Callable[[], list[_Verified]]
) -> dict[int, _Verified]:
    """``verify()``'s outcomes by request; {} when there are none or it raised."""
    if not request_ids:
        return {}
    try:
        return dict(zip(request_ids, verify(), strict=True))
    except Exception:
        return {}


class Engine:
    """Continuous-batching generation over a paged KV cache.

    ``token_bytes`` turns a token id into its raw bytes (the tokenizer supplies it).
    ``eos_token_id`` is the id, or the ids, that end a generation (every EOS the model's
    config files declare; Llama 3 has two, ``<|end_of_text|>`` and ``<|eot_id|>``).

    ``speculation`` turns on speculative decoding (``draft_model`` is its draft for the
    ``"draft"`` method: the target's vocabulary, at least ``max_model_len`` positions).
    Outputs are then exactly the target's: token for token at greedy, in distribution when
    sampled; a request with ``SamplingParams(speculative=False)`` never speculates.
    """

    def __init__(
        self,
        model: PagedModel,
        config: EngineConfig,
        *,
        eos_token_id: int | Collection[int] | None,
        token_bytes: Callable[[int], bytes],
        speculation: SpeculativeConfig | None = None,
        draft_model: PagedModel | None = None,
    ) -> None:
        if config.max_model_len > model.config.n_positions:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's "
                f"n_positions {model.config.n_positions}"
            )
        self.config = config
        self.eos_token_ids: frozenset[int] = frozenset(
            ()
            if eos_token_id is None
            else (eos_token_id,)
            if isinstance(eos_token_id, int)
            else eos_token_id
        )
        self._token_bytes = token_bytes
        self._vocab_size = model.config.vocab_size
        self.block_manager = BlockManager(config.num_blocks, config.block_size)
        self.scheduler = Scheduler(config.scheduler_config(), self.block_manager)
        self.model_runner = ModelRunner(
            model, model.make_kv_cache(config.num_blocks, config.block_size)
        )
        self.sampler = Sampler()
        self.speculator: Speculator | None = None
        if speculation is not None:
            self.speculator = Speculator.build(
                speculation,
                draft_model,
                model,
                num_blocks=config.num_blocks,
                block_size=config.block_size,
                max_model_len=config.max_model_len,
            )
        elif draft_model is not None:
            raise ValueError("a draft model needs a SpeculativeConfig with method 'draft'")
        self._requests: dict[int, _Request] = {}
        self._next_request_id = 0
        self._num_steps = 0
        self.last_step: StepStats | None = None  # the last step that completed
        # Sets the torch threads of each step when given (engine/threads.py); else the
        # process's setting stands.
        self.threads: ThreadGovernor | None = None

    # -- stats ----------------------------------------------------------------------------

    @property
    def spec_stats(self) -> SpecDecodeStats | None:
        """Speculative decoding's counters (a live object: snapshot it to hand it on)."""
        return None if self.speculator is None else self.speculator.stats

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_steps(self) -> int:
        """Steps completed (or failed) since the engine was made."""
        return self._num_steps

    @property
    def num_requests(self) -> int:
        """Requests added and neither finished nor aborted."""
        return len(self._requests)

    def block_manager_stats(self) -> BlockManagerStats:
        return self.block_manager.stats()

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # -- requests -------------------------------------------------------------------------

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Queue a request and return its id.

        Raises :class:`ValueError` for an empty prompt, a token id outside the vocabulary, or
        ``len(prompt) + max_tokens > max_model_len``, and the scheduler's
        :class:`~sluice.engine.scheduler.QueueFullError` while ``max_waiting`` requests wait.
        """
        if not prompt_token_ids:
            raise ValueError("the prompt needs at least one token")
        num_total = len(prompt_token_ids) + params.max_tokens
        if num_total > self.config.max_model_len:  # before the scan of a huge prompt's ids
            raise ValueError(
                f"prompt of {len(prompt_token_ids)} tokens plus max_tokens={params.max_tokens} "
                f"exceeds max_model_len={self.config.max_model_len}"
            )
        bad = [t for t in prompt_token_ids if not 0 <= t < self._vocab_size]
        if bad:
            raise ValueError(
                f"token ids {bad[:8]} are outside the vocabulary [0, {self._vocab_size})"
            )
        request_id = self._next_request_id
        seq = Sequence(request_id, prompt_token_ids, self.config.block_size)
        self.scheduler.add(seq)  # may raise QueueFullError: the id is then not used
        self._next_request_id += 1
        self._requests[request_id] = _Request(seq, params)
        return request_id

    def abort(self, request_id: int) -> bool:
        """Drop a request in any state, freeing its KV blocks now; False if unknown or done."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.abort(request_id)
        self._forget(request_id)
        return True

    def _forget(self, request_id: int) -> None:
        self.sampler.forget(request_id)
        if self.speculator is not None:
            self.speculator.forget(request_id)

    # -- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; return an output for each request that sampled a token, and a
        finished output with ``error`` for each request whose own row failed (aborted).

        If the model raises, every request in the batch is aborted (its blocks freed)
        before the error propagates, so the engine stays usable.
        """
        if self.threads is not None:
            self.threads.before_step()
        started = time.perf_counter()
        num_lookahead, k = self._plan_speculation()
        batch = self.scheduler.schedule(num_lookahead)
        drafts: dict[int, Draft] = {}
        try:
            drafts = self._propose(batch)
            logits: Mapping[int, torch.Tensor]
            if drafts:
                logits = self.model_runner.verify(
                    batch, {seq_id: draft.token_ids for seq_id, draft in drafts.items()}
                )
            else:  # one row each
                logits = self.model_runner.run(batch)
            sampled, outputs, finished = self._sample_and_check(batch, logits, drafts)
        except BaseException:
            for item in batch.items:
                self.abort(item.seq.seq_id)
            self.scheduler.postprocess(batch, {})
            raise
        finally:
            self._num_steps += 1
        self.scheduler.postprocess(batch, sampled, finished)
        for request_id in finished:
            self._requests.pop(request_id, None)
            self._forget(request_id)
        decodes = [item.seq.seq_id for item in batch.items if item.num_new_tokens == 1]
        num_prefill_tokens = sum(item.num_new_tokens for item in batch.items) - len(decodes)
        duration_s = time.perf_counter() - started
        self.last_step = StepStats(
            num_prefill_tokens=num_prefill_tokens,
            num_decodes=len(decodes),
            duration_s=duration_s,
            num_speculative_tokens=sum(len(draft.token_ids) for draft in drafts.values()),
            num_decode_tokens=sum(_num_tokens(sampled.get(seq_id, 0)) for seq_id in decodes),
        )
        if self.speculator is not None:
            self.speculator.observe(len(decodes), num_prefill_tokens, k, duration_s)
        if self.threads is not None:
            self.threads.after_step(num_prefill_tokens, len(decodes), duration_s)
        return outputs

    def _plan_speculation(self) -> tuple[dict[int, int], int]:
        """The lookahead each decoding sequence asks for this step, and the step's k."""
        if self.speculator is None:
            return {}, 0
        decodes = [
            (seq, self._requests[seq.seq_id].params)
            for seq in self.scheduler.running
            if seq.num_tokens - seq.num_computed_tokens == 1
        ]
        return self.speculator.plan(decodes, self.config.max_model_len)

    def _propose(self, batch: ScheduledBatch) -> dict[int, Draft]:
        if self.speculator is None:
            return {}
        requests: list[DraftRequest] = []
        for item in batch.items:
            request = self._requests.get(item.seq.seq_id)
            if item.num_lookahead_tokens and request is not None:
                params = request.params
                generator = self.sampler.generator_for(item.seq.seq_id, params)
                requests.append(
                    DraftRequest(item.seq, item.num_lookahead_tokens, params, generator)
                )
        return self.speculator.propose(requests)

    def _sample_and_check(
        self, batch: ScheduledBatch, logits: Mapping[int, torch.Tensor], drafts: dict[int, Draft]
    ) -> tuple[dict[int, tuple[int, ...]], list[RequestOutput], set[int]]:
        request_ids = [seq_id for seq_id in batch.sampled_seq_ids if seq_id in self._requests]
        if not request_ids:
            return {}, [], set()
        plain = [request_id for request_id in request_ids if request_id not in drafts]
        results: dict[int, tuple[list[int], list[float]] | Exception] = {}
        if plain:
            for request_id, one in zip(
                plain,
                self.sampler.sample(
                    logits.rows(plain)
                    if isinstance(logits, StepLogits)
                    else torch.stack([logits[request_id][0] for request_id in plain]),
                    [self._requests[request_id].params for request_id in plain],
                    plain,
                ),
                strict=True,
            ):
                results[request_id] = (
                    one if isinstance(one, Exception) else ([one.token_id], [one.logprob])
                )
        results.update(self._verify_together(logits, drafts))
        for request_id, draft in drafts.items():
            if request_id in self._requests and request_id not in results:
                results[request_id] = self._verify(request_id, logits[request_id], draft)
        produced_at = time.monotonic()
        sampled: dict[int, tuple[int, ...]] = {}
        outputs: list[RequestOutput] = []
        finished: set[int] = set()
        for request_id in request_ids:
            request, outcome = self._requests[request_id], results[request_id]
            seq = request.seq
            if request.num_cached_tokens is None:
                request.num_cached_tokens = seq.num_cached_tokens
            try:
                if isinstance(outcome, Exception):
                    raise outcome
                tokens, logprobs = outcome
                text, reason, num_kept = self._check_finish(request, tokens)
            except Exception as exc:  # this request's fault alone: the batch goes on
                outputs.append(self._fail(request, exc, produced_at))
                continue
            sampled[seq.seq_id] = tuple(tokens[:num_kept])
            if reason is not None:
                finished.add(seq.seq_id)
            outputs.append(
                RequestOutput(
                    request_id=seq.seq_id,
                    new_text=text,
                    new_token_ids=tuple(tokens[:num_kept]),
                    finished=reason is not None,
                    finish_reason=reason,
                    num_prompt_tokens=seq.num_prompt_tokens,
                    num_completion_tokens=seq.num_completion_tokens + num_kept,
                    num_cached_tokens=request.num_cached_tokens,
                    logprobs=tuple(logprobs[:num_kept]) if request.params.logprobs else None,
                    produced_at=produced_at,
                    stop_sequence=request.detokenizer.stop if reason == "stop" else None,
                )
            )
        return sampled, outputs, finished

    def _verify(
        self, request_id: int, logits: torch.Tensor, draft: Draft
    ) -> tuple[list[int], list[float]] | Exception:
        """The tokens the acceptance rule keeps of ``draft`` (and one more), or this row's
        exception."""
        params = self._requests[request_id].params
        if self.speculator is None:
            raise RuntimeError("a draft without a speculator")
        try:
            return self.speculator.verify(
                logits, draft, params, self.sampler.generator_for(request_id, params)
            )
        except Exception as exc:
            return exc

    def _verify_together(
        self, logits: Mapping[int, torch.Tensor], drafts: dict[int, Draft]
    ) -> dict[int, _Verified]:
        """The live requests' verifies, the greedy ones in one pass and the sampled ones in
        another; a pass that raised gives nothing (its requests are then verified alone, so
        that only a faulty row fails)."""
        speculator = self.speculator
        live = [request_id for request_id in drafts if request_id in self._requests]
        if speculator is None or not live:
            return {}
        greedy = [r for r in live if self._requests[r].params.greedy]
        sampled = [
            (r, self._requests[r].params) for r in live if not self._requests[r].params.greedy
        ]
        results = _one_pass(
            greedy, lambda: speculator.verify_greedy([(logits[r], drafts[r]) for r in greedy])
        )
        rows = [
            (logits[r], drafts[r], params, self.sampler.generator_for(r, params))
            for r, params in sampled
        ]
        results.update(_one_pass([r for r, _ in sampled], lambda: speculator.verify_sampled(rows)))
        return results

    def _fail(self, request: _Request, exc: Exception, produced_at: float) -> RequestOutput:
        """Abort one request whose row failed (between schedule and postprocess, which then
        skips it) and make its last output; the traceback goes to the log."""
        seq = request.seq
        logger.error("request %d failed in the engine; aborted alone", seq.seq_id, exc_info=exc)
        self.abort(seq.seq_id)
        message = str(exc) if isinstance(exc, SamplingError) else REQUEST_FAILED_MESSAGE
        return RequestOutput(
            request_id=seq.seq_id,
            new_text="",
            new_token_ids=(),
            finished=True,
            finish_reason=None,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_completion_tokens=seq.num_completion_tokens,
            num_cached_tokens=request.num_cached_tokens or 0,
            produced_at=produced_at,
            error=message,
        )

    def _check_finish(
        self, request: _Request, tokens: list[int]
    ) -> tuple[str, FinishReason | None, int]:
        """The text ``tokens`` release, why the request ends with them if it does, and how
        many of them it keeps: a request that ends at a token drops the tokens after it."""
        params, detokenizer = request.params, request.detokenizer
        released: list[str] = []
        for number, token in enumerate(tokens, 1):
            is_eos = token in self.eos_token_ids and not params.ignore_eos
            if is_eos or token in params.stop_token_ids:
                return "".join(released) + detokenizer.flush(), "stop", number
            released.append(detokenizer.push(self._token_bytes(token)))
            if detokenizer.stop is not None:
                return "".join(released), "stop", number
            num_completion_tokens = request.seq.num_completion_tokens + number
            num_tokens = request.seq.num_tokens + number
            if (
                num_completion_tokens >= params.max_tokens
                or num_tokens >= self.config.max_model_len
            ):
                return "".join(released) + detokenizer.flush(), "length", number
        return "".join(released), None, len(tokens)


def _num_tokens(tokens: int | tuple[int, ...]) -> int:
    return 1 if isinstance(tokens, int) else len(tokens)
