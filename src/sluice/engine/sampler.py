"""Sampling the next token of each sequence in a batch from its logits (torch).

Per row: temperature scaling, top-k, then top-p (nucleus) filtering, then a draw (inverse
CDF, :func:`draw_tokens`: a tenth of ``torch.multinomial``'s time on the CPU); a
temperature below :data:`~sluice.engine.sampling_params.GREEDY_TEMPERATURE` (0 included)
takes the argmax. A row with a ``seed`` draws from its own ``torch.Generator``, so its
tokens are the same whatever else shares the batch.

On the CPU the sampled rows of a step are filtered and drawn in one call of the C kernel
(:class:`~sluice.engine.models.native_sampling.NativeSampling`: the same filters, the same
uniforms from the same generators, a few passes a row where torch makes a dozen whole-batch
calls), and the greedy rows in another (each row's first maximum and its logprob, two passes
a row where torch made five whole-batch calls); other devices and ``SLUICE_NATIVE_KERNELS=0``
take the torch code here, which is the reference the kernels are tested against.

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

from sluice.engine.models.native_build import NativeKernelError
from sluice.engine.models.native_sampling import NativeSampling, load_native_sampling
from sluice.engine.sampling_params import SamplingParams

__all__ = [
    "NonFiniteLogitsError",
    "Sampled",
    "Sampler",
    "SamplingError",
    "draw_tokens",
    "draw_uniforms",
    "filter_logits",
    "filter_rows",
    "filtered_probs",
    "invert_cdf",
]


class SamplingError(ValueError):
    """One row cannot be sampled; its message is safe to show to the request's client."""


class NonFiniteLogitsError(SamplingError):
    """The model's logits for this row hold NaN or +inf, or no finite value at all."""

    def __init__(self) -> None:
        super().__init__("the model produced non-finite logits for this request")


@dataclass(frozen=True, slots=True)
class Sampled:
    """One row's next token and its logprob under the model's (unfiltered) distribution.

    The greedy kernel leaves the logprob out (NaN) where the request did not ask for
    logprobs: the softmax's sum is most of its work."""

    token_id: int
    logprob: float


def draw_tokens(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of ``probs`` ``[n, vocab]`` (non-negative, each row with some
    mass; it need not sum to 1), drawn in proportion to it by :func:`invert_cdf` at a
    uniform from ``generator`` (the global one when None). Returns ``[n]``.

    ``torch.multinomial`` takes about 120 µs a row of 4,096 on the CPU; this about 15."""
    uniform = torch.rand(probs.shape[0], generator=generator, dtype=torch.float64)
    return invert_cdf(probs, uniform.to(probs.device))


def invert_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Each row's token where its CDF (in float64) first passes ``uniform`` (``[n]``, in
    [0, 1)) of the row's mass; a token without mass is never chosen."""
    cdf = probs.double().cumsum(dim=-1)
    tokens = torch.searchsorted(cdf, uniform[:, None] * cdf[:, -1:], right=True)[:, 0]
    overshot = tokens >= probs.shape[-1]
    if bool(overshot.any()):  # u * mass rounded up to the mass: the last token with mass
        last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1)
        tokens = torch.where(overshot, last, tokens)
    return tokens


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row's logits after temperature, top-k and top-p (removed entries are -inf).

    Finite logits give values ``<= 0`` or ``-inf`` with at least one 0 (never NaN); greedy
    params keep the argmax alone."""
    return filter_rows(logits[None], params)[0]


def filter_rows(rows: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """:func:`filter_logits` of each row of ``rows`` ``[n, vocab]``, all under ``params``,
    in one pass."""
    shifted = rows.float() - rows.float().max(dim=-1, keepdim=True).values
    if params.greedy:
        keep = torch.zeros_like(shifted, dtype=torch.bool)
        keep.scatter_(1, torch.argmax(shifted, dim=-1, keepdim=True), True)
        return shifted.masked_fill(~keep, float("-inf"))
    scaled = shifted / params.temperature  # <= 0 over a positive divisor: no NaN, no +inf
    if 0 < params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens before it already reach top_p. The first is always
        # kept: a top_p below float32's smallest value (1e-300) compares as 0.
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= params.top_p
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def filtered_probs(rows: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``softmax(filter_logits(row, params[i]))`` of each row ``i`` of ``rows`` ``[n,
    vocab]``: the rows that share a filter (temperature, top-k, top-p) in one pass."""
    if len(params) != rows.shape[0]:
        raise ValueError("need one params per row")
    groups: dict[tuple[bool, float, int, float], list[int]] = {}
    for row, row_params in enumerate(params):
        key = (row_params.greedy, row_params.temperature, row_params.top_k, row_params.top_p)
        groups.setdefault(key, []).append(row)
    if len(groups) == 1:
        return torch.softmax(filter_rows(rows, params[0]), dim=-1)
    probs = torch.empty(rows.shape, dtype=torch.float32, device=rows.device)
    for group in groups.values():
        index = torch.tensor(group, device=rows.device)
        probs[index] = torch.softmax(filter_rows(rows[index], params[group[0]]), dim=-1)
    return probs


def draw_uniforms(
    generators: Sequence[torch.Generator | None], counts: Sequence[int]
) -> torch.Tensor:
    """``counts[i]`` uniforms in [0, 1) (float64) for each ``i``, one after another: from
    ``generators[i]``, or, where that is None, from torch's global generator (all of those
    in one call)."""
    unseeded = sum(
        count for generator, count in zip(generators, counts, strict=True) if generator is None
    )
    shared = torch.rand(unseeded, dtype=torch.float64) if unseeded else None
    pieces, taken = [], 0
    for generator, count in zip(generators, counts, strict=True):
        if generator is not None:
            pieces.append(torch.rand(count, generator=generator, dtype=torch.float64))
        elif shared is not None:
            pieces.append(shared[taken : taken + count])
            taken += count
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.float64)


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
        native = load_native_sampling() if rows.device.type == "cpu" else None
        if native is None:
            return self._sample_torch(rows, params, request_ids)
        greedy = [row for row, row_params in enumerate(params) if row_params.greedy]
        sampled = [row for row, row_params in enumerate(params) if not row_params.greedy]
        results: list[Sampled | Exception | None] = [None] * len(params)
        if greedy:
            picked = rows if not sampled else rows[torch.tensor(greedy)]
            tokens, logprobs = native.greedy(picked, [params[row].logprobs for row in greedy])
            for row, token, logprob in zip(greedy, tokens, logprobs, strict=True):
                results[row] = NonFiniteLogitsError() if token < 0 else Sampled(token, logprob)
        if sampled:
            try:
                drawn = self._sample_native(native, rows, sampled, params, request_ids)
            except NativeKernelError:  # not expected (params are validated): the torch path
                index = torch.tensor(sampled)
                drawn = self._sample_torch(
                    rows[index],
                    [params[row] for row in sampled],
                    [request_ids[row] for row in sampled],
                )
            for row, one in zip(sampled, drawn, strict=True):
                results[row] = one
        return [one for one in results if one is not None]

    def _sample_native(
        self,
        native: NativeSampling,
        rows: torch.Tensor,
        sampled: list[int],
        params: Sequence[SamplingParams],
        request_ids: Sequence[int],
    ) -> list[Sampled | Exception]:
        """The ``sampled`` rows' tokens through the C kernel, in order."""
        if len(sampled) < rows.shape[0]:
            rows = rows[torch.tensor(sampled)]
        generators = [self.generator_for(request_ids[row], params[row]) for row in sampled]
        uniforms = draw_uniforms(generators, [1] * len(sampled))
        tokens, logprobs = native.sample(rows, [params[row] for row in sampled], uniforms)
        return [
            NonFiniteLogitsError() if token < 0 else Sampled(token, logprob)
            for token, logprob in zip(tokens, logprobs, strict=True)
        ]

    def _sample_torch(
        self,
        rows: torch.Tensor,
        params: Sequence[SamplingParams],
        request_ids: Sequence[int],
    ) -> list[Sampled | Exception]:
        """:meth:`sample` in torch (``rows`` float32)."""
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
        drawn = self._draw_sampled_rows(rows, log_probs, params, request_ids, finite)
        results: list[Sampled | Exception] = []
        for row, (row_params, request_id) in enumerate(zip(params, request_ids, strict=True)):
            if not finite[row]:
                results.append(NonFiniteLogitsError())
                continue
            if row_params.greedy:
                results.append(Sampled(greedy_tokens[row], greedy_logprobs[row]))
                continue
            if row in drawn:
                results.append(drawn[row])
                continue
            try:
                token = self._draw(rows[row], row_params, request_id)
                results.append(Sampled(token, float(log_probs[row, token])))
            except Exception as exc:  # this row's fault: the others still get their tokens
                results.append(exc)
        return results

    def _draw_sampled_rows(
        self,
        rows: torch.Tensor,
        log_probs: torch.Tensor,
        params: Sequence[SamplingParams],
        request_ids: Sequence[int],
        finite: list[bool],
    ) -> dict[int, Sampled]:
        """The finite sampled rows' tokens in one pass (rows sharing a filter filtered
        together, one inverse-CDF draw for all); {} when that pass raised, and the rows are
        then drawn one by one, so that only a faulty row fails."""
        sampled = [
            row for row, row_params in enumerate(params) if finite[row] and not row_params.greedy
        ]
        if not sampled:
            return {}
        try:
            index = torch.tensor(sampled, device=rows.device)
            probs = filtered_probs(rows[index], [params[row] for row in sampled])
            generators = [self.generator_for(request_ids[row], params[row]) for row in sampled]
            uniforms = draw_uniforms(generators, [1] * len(sampled)).to(probs.device)
            tokens = invert_cdf(probs, uniforms)
            logprobs = log_probs[index].gather(1, tokens[:, None])[:, 0]
        except Exception:
            return {}
        return {
            row: Sampled(token, logprob)
            for row, token, logprob in zip(sampled, tokens.tolist(), logprobs.tolist(), strict=True)
        }

    def _draw(self, logits: torch.Tensor, params: SamplingParams, request_id: int) -> int:
        if params.greedy:
            return int(torch.argmax(logits))
        probs = torch.softmax(filter_logits(logits, params), dim=-1)
        generator = None
        if params.seed is not None:
            generator = self._generator(request_id, params.seed)
        return int(draw_tokens(probs.cpu()[None], generator)[0])
