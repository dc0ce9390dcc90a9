"""The LM head as one matrix product over a transposed copy of its weight (torch).

An ``nn.Linear`` head computes ``hidden @ weight.T`` with ``weight`` stored ``[vocab,
hidden]``. On the CPU, with one thread, that kernel is twice as slow for a few rows as a
plain ``mm`` against the same weight stored ``[hidden, vocab]`` (measured for the bundled
``sluice-tiny``'s 4,096 x 256 head: 290 µs against 160 µs for the 5 rows of a speculative
verify, 946 µs against 812 µs for 64 decodes; 1 row the same), and a verify or a batch of
decodes is a few rows. :class:`LMHead` keeps that transposed copy, made on first use and
made again whenever the weight changes (``load_state_dict`` copies into it in place, which
bumps its version counter) or is replaced (the loader assigns the tied embedding to the
head after loading), so the model's parameters stay what they were (the tied embedding, the
Hugging Face names).

The copy carries no autograd history: with gradients wanted (not an engine step), the head
is the plain ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LMHead"]


class LMHead:
    """``linear(hidden)`` for a bias-free ``linear``, through a cached transpose of its
    weight (read from ``linear`` at every call: it may be replaced)."""

    def __init__(self, linear: nn.Linear) -> None:
        self._linear: nn.Linear = linear
        self._source: torch.Tensor | None = None  # the weight the copy was made of
        self._source_version: int = 0
        self._transposed: torch.Tensor | None = None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self._linear.weight
        if torch.is_grad_enabled() and weight.requires_grad:
            return F.linear(hidden, weight)
        return torch.mm(hidden, self.transposed_weight())

    def transposed_weight(self) -> torch.Tensor:
        """The head's weight as a contiguous ``[hidden, vocab]`` copy, up to date."""
        weight = self._linear.weight
        if (
            self._transposed is None
            or self._source is not weight
            or self._source_version != weight._version
        ):
            # A normal tensor even when first made under inference_mode, so that a later
            # call outside it may read the copy.
            with torch.inference_mode(False), torch.no_grad():
                self._transposed = weight.detach().t().contiguous()
            self._source, self._source_version = weight, weight._version
        return self._transposed
