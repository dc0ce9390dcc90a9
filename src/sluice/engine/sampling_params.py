"""Sampling parameters of one request: validated once, when the request is added."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["GREEDY_TEMPERATURE", "MAX_STOP_STRINGS", "MAX_TEMPERATURE", "SamplingParams"]

# Stop strings are checked against held-back text on every token: keep the set small.
MAX_STOP_STRINGS = 16

# A temperature below this is greedy (argmax), 0 included: vLLM's rule (its _SAMPLING_EPS),
# so a client moving between the two sees the same. At 1e-5 a logit gap of 1e-3 already
# has odds of e**-100, so sampling could only differ from the argmax on an exact tie;
# dividing by still smaller values (1e-300, 5e-324) is where float32 logits overflow.
GREEDY_TEMPERATURE = 1e-5
# The largest temperature accepted: past it the distribution is uniform in all but name.
MAX_TEMPERATURE = 100.0


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature`` below :data:`GREEDY_TEMPERATURE` (0 included) is greedy. ``top_k == 0`` and ``top_p == 1`` turn those filters
    off. ``seed`` makes one request's sampling reproducible whatever else is in the batch.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: Sequence[str] = field(default=())
    stop_token_ids: Sequence[int] = field(default=())
    ignore_eos: bool = False
    logprobs: bool = False
    speculative: bool = True  # False: never speculate for this request (an opt-out)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(
                f"temperature must be between 0 and {MAX_TEMPERATURE:g}, got {self.temperature}"
            )
        if self.top_k < 0:
            raise ValueError(f"top_k must not be negative, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        # Freeze the sequences so the value stays immutable and hashable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE
