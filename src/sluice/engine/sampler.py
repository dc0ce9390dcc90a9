"""Sampling the next token of each sequence in a batch from its logits (torch).

Per row: temperature scaling, top-k, then top-p (nucleus) filtering, then a draw; a
temperature below :data:`~sluice.engine.sampling_params.GREEDY_TEMPERATURE` (0 included)
takes the argmax. A row with a ``seed`` draws from its own ``torch.Generator``, so its
tokens are the same whatever else shares the batch.

Numerically safe for every value :class:`~sluice.engine.sampling_params.SamplingParams`
accepts. The logits are shifted so that their maximum is 0 BEFORE they are divided by the
temperature, so the scaled logits are all ``<= 0`` with one exactly 0: a small temperature
can send the others to ``-inf`` (probability 0), never to ``+inf`` or NaN, and the softmax
always has a finite, positive denominator. Top-k and top-p always keep the most likely
token, so a draw always has a token of positive probability to land on.

Faults are per row: :meth:`Sampler.sample` puts a row's exception in that row's place and
samples the others. A row whose logits hold NaN or ``+inf``, or are all ``-inf`` (a broken
checkpoint, an overflow in the model), gets :class:`NonFiniteLogitsError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sluice.engine.sampling_params import SamplingParams

__all__ = ["NonFiniteLogitsError", "Sampled", "Sampler", "SamplingError", "filter_logits"]


class SamplingError(ValueError):
    """One row cannot be sampled; its message is safe to show to the request's client."""


class NonFiniteLogitsError(SamplingError):
    """The model's logits for this row hold NaN or +inf, or no finite value at all."""

    def __init__(self) -> None:
        super().__init__("the model produced non-finite logits for this request")


@dataclass(frozen=True, slots=True)
class Sampled:
    """One row's next token and its logprob under the model's (unfiltered) distribution."""

    token_id: int
    logprob: float


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row's logits after temperature, top-k and top-p (removed entries are -inf).

    Finite logits give values ``<= 0`` or ``-inf`` with at least one 0 (never NaN); greedy
    params keep the argmax alone."""
    shifted = logits.float() - logits.float().max()
    if params.greedy:
        keep = torch.zeros_like(shifted, dtype=torch.bool)
        keep[torch.argmax(shifted)] = True
        return shifted.masked_fill(~keep, float("-inf"))
    scaled = shifted / params.temperature  # <= 0 over a positive divisor: no NaN, no +inf
    if 0 < params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens before it already reach top_p. The first is always
        # kept: a top_p below float32's smallest value (1e-300) compares as 0.
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= params.top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


class Sampler:
    """Keeps one generator per seeded request, keyed by request id."""

    def __init__(self) -> None:
        self._generators: dict[int, torch.Generator] = {}

    def forget(self, request_id: int) -> None:
        """The request ended: drop its generator."""
        self._generators.pop(request_id, None)

    def generator_for(self, request_id: int, params: SamplingParams) -> torch.Generator | None:
        """The request's own generator when it has a ``seed``; None (the global one) if not."""
        return None if params.seed is None else self._generator(request_id, params.seed)

    def _generator(self, request_id: int, seed: int) -> torch.Generator:
        generator = self._generators.get(request_id)
        if generator is None:
            generator = torch.Generator(device="cpu").manual_seed(seed)
            self._generators[request_id] = generator
        return generator

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        request_ids: Sequence[int],
    ) -> list[Sampled | Exception]:
        """The next token of each row of ``logits`` ``[batch, vocab]``, with its logprob.

        A row that cannot be sampled gets its exception in its place
        (:class:`NonFiniteLogitsError`, or whatever else went wrong with it); the other
        rows are sampled all the same. Raises :class:`ValueError` for mismatched shapes."""
        if logits.dim() != 2 or not logits.shape[0] == len(params) == len(request_ids):
            raise ValueError("logits must be [batch, vocab] with one params per row")
        rows = logits.float()
        log_probs = torch.log_softmax(rows, dim=-1)
        # The max is NaN when a row holds a NaN, +inf with a +inf, -inf when all are -inf.
        # Its indices are each row's first maximum, argmax's rule, at a third of the cost of
        # a batched argmax on the CPU.
        top, tokens = rows.max(dim=-1)
        finite = torch.isfinite(top).tolist()
        # Greedy rows, the common case, take that max and one gather for the whole batch,
        # not a few calls per row.
        greedy_tokens: list[int] = []
        greedy_logprobs: list[float] = []
        if any(row_params.greedy for row_params in params):
            greedy_tokens = tokens.tolist()
            greedy_logprobs = log_probs.gather(1, tokens[:, None])[:, 0].tolist()
        results: list[Sampled | Exception] = []
        for row, (row_params, request_id) in enumerate(zip(params, request_ids, strict=True)):
            if not finite[row]:
                results.append(NonFiniteLogitsError())
                continue
            if row_params.greedy:
                results.append(Sampled(greedy_tokens[row], greedy_logprobs[row]))
                continue
            try:
                token = self._draw(rows[row], row_params, request_id)
                results.append(Sampled(token, float(log_probs[row, token])))
            except Exception as exc:  # this row's fault: the others still get their tokens
                results.append(exc)
        return results

    def _draw(self, logits: torch.Tensor, params: SamplingParams, request_id: int) -> int:
        if params.greedy:
            return int(torch.argmax(logits))
        probs = torch.softmax(filter_logits(logits, params), dim=-1)
        generator = None
        if params.seed is not None:
            generator = self._generator(request_id, params.seed)
        return int(torch.multinomial(probs.cpu(), 1, generator=generator))
