"""What ``sluice bench`` measured: per-request results, per-level figures, and their renderings.

Pure Python: results go in, a :class:`LevelReport` comes out (:func:`summarize`), and
reports become a markdown table (:func:`markdown_table`), a JSON-ready dict
(:func:`report_document`) or, when matplotlib happens to be installed, a PNG
(:func:`write_plot`, the only function that touches the file system). :class:`Progress`
draws the live one-line progress bar on a text stream it is given.

Percentiles interpolate linearly between the two nearest ranks (numpy's default), so they
never decrease with ``q``: p50 <= p90 <= p99 always holds.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

__all__ = [
    "LevelReport",
    "Outcome",
    "Percentiles",
    "Progress",
    "RequestResult",
    "markdown_table",
    "percentile",
    "report_document",
    "summarize",
    "write_plot",
]

# Distinct error kinds kept per level (the rest are counted under "other"): a level of a
# thousand failures with unique messages must not make a thousand-line report.
MAX_ERROR_KINDS = 8


class Outcome(enum.Enum):
    """How one request ended."""

    OK = "ok"
    REFUSED = "refused"  # HTTP 429 or 503 before any body: the server shed load
    ERROR = "error"  # any other status, an in-band error, a transport error, a timeout


@dataclass(frozen=True, slots=True)
class RequestResult:
    """One request, as the client saw it; times in seconds from when it was sent."""

    outcome: Outcome
    e2e_s: float
    ttft_s: float | None = None  # None when no token arrived
    itl_s: tuple[float, ...] = ()  # one entry per gap between consecutive token events
    num_output_tokens: int = 0  # usage.completion_tokens when sent, else token events
    status: int | None = None  # HTTP status of the (last) response, None without one
    retry_after_s: float | None = None  # a refusal's Retry-After, when it had one
    error: str | None = None  # a short kind for errors ("http 404", "timeout", ...)


@dataclass(frozen=True, slots=True)
class Percentiles:
    """p50/p90/p99 of a sample, in milliseconds; all ``None`` for an empty sample."""

    p50: float | None
    p90: float | None
    p99: float | None

    @classmethod
    def of_seconds(cls, values_s: Sequence[float]) -> Percentiles:
        ordered = sorted(values_s)
        if not ordered:
            return cls(None, None, None)
        p50, p90, p99 = (percentile(ordered, q) * 1000 for q in (50, 90, 99))
        return cls(p50, p90, p99)


@dataclass(frozen=True, slots=True)
class LevelReport:
    """The figures of one load level (one concurrency or one request rate)."""

    load: str  # "concurrency" or "rate"
    level: float  # workers, or requests per second
    wall_s: float
    num_requests: int
    num_ok: int
    num_refused: int
    num_errors: int
    num_output_tokens: int  # received, whatever the request's outcome
    output_tokens_per_s: float
    requests_per_s: float
    ttft_ms: Percentiles
    itl_ms: Percentiles
    e2e_ms: Percentiles
    max_retry_after_s: float | None
    errors: dict[str, int]  # error kind -> count, at most MAX_ERROR_KINDS + "other"


def percentile(ordered: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of a non-empty, ascending sequence."""
    if not ordered:
        raise ValueError("percentile of an empty sample")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be within 0..100, not {q}")
    rank = q / 100 * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _error_counts(results: Sequence[RequestResult]) -> dict[str, int]:
    counts = Counter(r.error or "unknown" for r in results if r.outcome is Outcome.ERROR)
    kept = dict(counts.most_common(MAX_ERROR_KINDS))
    other = sum(counts.values()) - sum(kept.values())
    if other:
        kept["other"] = other
    return kept


def summarize(
    load: str, level: float, results: Sequence[RequestResult], wall_s: float
) -> LevelReport:
    """Reduce one level's results; ``wall_s`` is from its first send to its last reply."""
    outcomes = Counter(r.outcome for r in results)
    num_output_tokens = sum(r.num_output_tokens for r in results)
    retry_after = [r.retry_after_s for r in results if r.retry_after_s is not None]
    per_s = 1 / wall_s if wall_s > 0 else 0.0
    return LevelReport(
        load=load,
        level=level,
        wall_s=wall_s,
        num_requests=len(results),
        num_ok=outcomes[Outcome.OK],
        num_refused=outcomes[Outcome.REFUSED],
        num_errors=outcomes[Outcome.ERROR],
        num_output_tokens=num_output_tokens,
        output_tokens_per_s=num_output_tokens * per_s,
        requests_per_s=len(results) * per_s,
        ttft_ms=Percentiles.of_seconds([r.ttft_s for r in results if r.ttft_s is not None]),
        itl_ms=Percentiles.of_seconds([gap for r in results for gap in r.itl_s]),
        e2e_ms=Percentiles.of_seconds([r.e2e_s for r in results if r.outcome is Outcome.OK]),
        max_retry_after_s=max(retry_after, default=None),
        errors=_error_counts(results),
    )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _level(report: LevelReport) -> str:
    return f"c={report.level:g}" if report.load == "concurrency" else f"{report.level:g}/s"


def markdown_table(reports: Sequence[LevelReport]) -> str:
    """One row per level: counts, TTFT and ITL percentiles (ms), throughput."""
    header = (
        "| load | requests | ok | refused | errors "
        "| TTFT p50 | TTFT p90 | TTFT p99 | ITL p50 | ITL p90 | ITL p99 "
        "| output tok/s | req/s |"
    )
    rows = [header, "|" + "---|" * 13]
    for r in reports:
        cells = [
            _level(r),
            str(r.num_requests),
            str(r.num_ok),
            str(r.num_refused),
            str(r.num_errors),
            *(_ms(v) for v in (r.ttft_ms.p50, r.ttft_ms.p90, r.ttft_ms.p99)),
            *(_ms(v) for v in (r.itl_ms.p50, r.itl_ms.p90, r.itl_ms.p99)),
            f"{r.output_tokens_per_s:.1f}",
            f"{r.requests_per_s:.2f}",
        ]
        rows.append("| " + " | ".join(cells) + " |")
    notes = ["", "TTFT and ITL (inter-token latency) in milliseconds."]
    for r in reports:
        if r.errors:
            kinds = ", ".join(f"{kind} x{count}" for kind, count in r.errors.items())
            notes.append(f"- {_level(r)} errors: {kinds}")
        if r.max_retry_after_s is not None:
            notes.append(f"- {_level(r)} refusals: Retry-After up to {r.max_retry_after_s:g} s")
    return "\n".join(rows + notes) + "\n"


def report_document(
    reports: Sequence[LevelReport], settings: dict[str, object]
) -> dict[str, object]:
    """Everything measured, with the run's settings, ready for JSON."""
    return {"settings": settings, "levels": [dataclasses.asdict(r) for r in reports]}


def write_plot(reports: Sequence[LevelReport], path: Path) -> str:
    """Plot TTFT/ITL percentiles and throughput against the level as a PNG, if possible.

    matplotlib is not a dependency of Sluice: without it nothing is written and the returned
    message says so. Returns a one-line message either way.
    """
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError:
        return f"plot skipped: matplotlib is not installed (wanted {path})"
    matplotlib.use("Agg")  # no display; must precede importing pyplot
    pyplot = importlib.import_module("matplotlib.pyplot")
    levels = [r.level for r in reports]
    figure, (latency, throughput) = pyplot.subplots(1, 2, figsize=(11, 4))
    for name in ("ttft_ms", "itl_ms"):
        for q in ("p50", "p90", "p99"):
            values = [getattr(getattr(r, name), q) for r in reports]
            latency.plot(levels, values, marker="o", label=f"{name[:-3].upper()} {q}")
    latency.set_ylabel("ms")
    latency.legend(fontsize="small")
    throughput.plot(levels, [r.output_tokens_per_s for r in reports], marker="o")
    throughput.set_ylabel("output tokens/s")
    xlabel = "concurrency" if reports and reports[0].load == "concurrency" else "requests/s"
    for axes in (latency, throughput):
        axes.set_xlabel(xlabel)
        axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
    return f"plot written to {path}"


class Progress:
    """A one-line text progress bar on ``stream``, redrawn in place with ``\\r``."""

    def __init__(self, stream: TextIO, *, width: int = 24, min_interval_s: float = 0.1) -> None:
        self._stream, self._width, self._min_interval_s = stream, width, min_interval_s
        self._label = ""
        self._total = 0
        self._duration_s: float | None = None
        self._started = self._drawn = 0.0
        self._drawn_chars = 0
        self._counts = dict.fromkeys(Outcome, 0)

    def start(self, label: str, total: int | None, duration_s: float | None) -> None:
        """Begin a level of ``total`` requests or ``duration_s`` seconds (the other None)."""
        self._label, self._total, self._duration_s = label, total or 0, duration_s
        self._counts = dict.fromkeys(Outcome, 0)
        self._started = self._drawn = time.perf_counter()
        self._draw()

    def update(self, result: RequestResult) -> None:
        self._counts[result.outcome] += 1
        if time.perf_counter() - self._drawn >= self._min_interval_s:
            self._draw()

    def finish(self) -> None:
        self._draw()
        self._stream.write("\n")
        self._stream.flush()
        self._drawn_chars = 0

    def _draw(self) -> None:
        self._drawn = now = time.perf_counter()
        done = sum(self._counts.values())
        elapsed = now - self._started
        if self._duration_s is not None:
            fraction = elapsed / self._duration_s
        else:
            fraction = done / self._total
        filled = round(min(fraction, 1.0) * self._width)
        of = f"/{self._total}" if self._duration_s is None else ""
        line = (
            f"\r{self._label:>8} [{'#' * filled}{'.' * (self._width - filled)}] {done}{of} "
            f"ok {self._counts[Outcome.OK]} refused {self._counts[Outcome.REFUSED]} "
            f"errors {self._counts[Outcome.ERROR]} {elapsed:.1f}s"
        )
        self._stream.write(line.ljust(self._drawn_chars))  # cover a longer earlier line
        self._drawn_chars = len(line)
        self._stream.flush()
