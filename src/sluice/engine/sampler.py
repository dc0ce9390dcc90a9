"""Sampling the next token of each sequence in a batch from its logits (torch).

Per row: temperature scaling, top-k, then top-p (nucleus) filtering, then a draw; a
temperature of 0 takes the argmax. A row with a ``seed`` draws from its own
``torch.Generator``, so its tokens are the same whatever else shares the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sluice.engine.sampling_params import SamplingParams

__all__ = ["Sampler", "filter_logits"]


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row's logits after temperature, top-k and top-p (removed entries are -inf)."""
    scaled = logits.float() / params.temperature
    if 0 < params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens before it already reach top_p (keeps at least one).
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= params.top_p
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
    ) -> tuple[list[int], list[float]]:
        """The next token of each row of ``logits`` ``[batch, vocab]``, and its logprob."""
        if logits.dim() != 2 or not logits.shape[0] == len(params) == len(request_ids):
            raise ValueError("logits must be [batch, vocab] with one params per row")
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        tokens: list[int] = []
        for row, (row_params, request_id) in enumerate(zip(params, request_ids, strict=True)):
            if row_params.greedy:
                token = int(torch.argmax(logits[row]))
            else:
                probs = torch.softmax(filter_logits(logits[row], row_params), dim=-1)
                generator = None
                if row_params.seed is not None:
                    generator = self._generator(request_id, row_params.seed)
                token = int(torch.multinomial(probs.cpu(), 1, generator=generator))
            tokens.append(token)
        index = torch.tensor(tokens, device=log_probs.device).unsqueeze(1)
        chosen = log_probs.gather(1, index).squeeze(1).tolist()
        return tokens, chosen
