"""Each version's recent streams, summarised for the dashboard and ``GET /v1/admin/rollouts``.

The last :data:`RECENT_STREAMS` streams of a version (bounded rings): TTFT p50/p99, mean
inter-token latency p50/p99, error and cancellation rates. Descriptive only: decisions are
the analysis's (:mod:`sluice.rollout.analysis`), over every stream of the rollout.
"""

from __future__ import annotations

from collections import deque
from typing import Final

import numpy as np

from sluice.rollout.analysis import Outcome

__all__ = ["RECENT_STREAMS", "RecentStreams"]

RECENT_STREAMS: Final = 500


class RecentStreams:
    """The recent streams of one version."""

    __slots__ = ("_cancelled", "_failed", "_itl", "_ttft", "num_streams")

    def __init__(self) -> None:
        self._ttft: deque[float] = deque(maxlen=RECENT_STREAMS)
        self._itl: deque[float] = deque(maxlen=RECENT_STREAMS)
        self._failed: deque[bool] = deque(maxlen=RECENT_STREAMS)
        self._cancelled: deque[bool] = deque(maxlen=RECENT_STREAMS)
        self.num_streams = 0  # since the server started

    def add(self, outcome: Outcome) -> None:
        self.num_streams += 1
        self._failed.append(outcome.failed)
        self._cancelled.append(outcome.cancelled)
        if outcome.ttft_s is not None:
            self._ttft.append(outcome.ttft_s)
        if outcome.itl_s is not None:
            self._itl.append(outcome.itl_s)

    def describe(self) -> dict[str, float | int | None]:
        recent = len(self._failed)
        ttft_p50, ttft_p99 = _percentiles(self._ttft)
        itl_p50, itl_p99 = _percentiles(self._itl)
        return {
            "streams": self.num_streams,
            "recent_streams": recent,
            "error_rate": round(sum(self._failed) / recent, 6) if recent else None,
            "cancel_rate": round(sum(self._cancelled) / recent, 6) if recent else None,
            "ttft_p50_s": ttft_p50,
            "ttft_p99_s": ttft_p99,
            "itl_p50_s": itl_p50,
            "itl_p99_s": itl_p99,
        }


def _percentiles(samples: deque[float]) -> tuple[float | None, float | None]:
    if not samples:
        return None, None
    p50, p99 = np.quantile(np.fromiter(samples, dtype=np.float64), (0.5, 0.99))
    return round(float(p50), 6), round(float(p99), 6)
