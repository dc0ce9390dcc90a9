"""The report of ``bench/served_throughput.py``: a row per set-up and level, ratios paired
within a run, the issue's served targets against the serving peers, greedy differences.

The targets (issue 15, "served over HTTP"): 64 concurrent streams, Sluice >= 1.0x vLLM CPU's
server and >= 1.5x ``transformers``' static batch (in-process, no HTTP: the issue's
reference); 1 at a time, Sluice >= 0.5x llama.cpp's ``llama-server``. Each is judged twice: for
Sluice's default set-up (``sluice serve --model``: the engine in a child process) and for
its best served set-up at that level (the highest median output tokens/s). A ratio is the median over runs
of the ratio within a run: the set-ups take turns, so a busy minute of a shared machine
falls on both sides of it. A verdict made while other jobs used more than
``MAX_QUIET_CORES`` in any of its runs says so: llama.cpp's spinning threads lose far more
than their share of a busy core.

A set-up with a request that failed or stopped short of its tokens has no figure at that
level (its tokens/s would be of other work), and no ratio or verdict is made of it; the
bench lists the requests as problems. Greedy texts: a Sluice set-up's that differs from the
first set-up's is a problem (the same engine); a peer's is a note, listed where it first
differs (the peers' kernels round differently).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "DEFAULT_SETUP",
    "ENGINE_ALONE",
    "HF_STATIC",
    "REPLICAS",
    "SLUICE_SERVED",
    "TARGETS",
    "Level",
    "Report",
    "best_setup",
    "judge",
    "paired_ratio",
    "render",
    "text_differences",
]

ENGINE_ALONE = "engine alone"
HF_STATIC = "HF static batch"  # transformers' generate, a static batch, in-process
DEFAULT_SETUP = "--engine-process"  # what `sluice serve --model` runs (since 2026-12-03)
BASE_SETUP = "one process"  # the ratio column: the engine on a thread of the server
REPLICAS = "--engine-replicas 2"  # two engine processes as one (sluice serve's option)
SLUICE_SERVED = ("one process", "two processes", "--engine-process", REPLICAS)
# (peer set-up, concurrent streams) -> the least Sluice / peer output tokens/s asked for.
TARGETS: dict[tuple[str, int], float] = {
    ("vLLM serve", 64): 1.0,
    ("llama-server", 1): 0.5,
    (HF_STATIC, 64): 1.5,
}
MAX_DIFFERENCES_LISTED = 5  # per peer and level
# A verdict made while other jobs used more than this many cores is marked: a server whose
# threads spin (llama.cpp's) loses far more than its share to them (as
# engine_peers.launcher.MAX_QUIET_BUSY_CORES).
MAX_QUIET_CORES = 0.25


@dataclass
class Level:
    """One set-up at one concurrency, over the runs."""

    tokens_per_s: list[float] = field(default_factory=list)
    ttft_p50_ms: list[float] = field(default_factory=list)
    cpu_ms_per_token: list[float] = field(default_factory=list)
    other_cores: list[float] = field(default_factory=list)  # other jobs', over each run
    texts: list[str] = field(default_factory=list)  # of the first run, in prompt order
    num_short: int = 0  # requests that failed or stopped short, over the runs

    def has_figure(self) -> bool:
        return bool(self.tokens_per_s) and self.num_short == 0


@dataclass(frozen=True)
class Report:
    lines: list[str]  # to print
    problems: list[str]  # the run's (exit 1)
    notes: list[str]  # facts to look at


def paired_ratio(level: Level, base: Level) -> float:
    """The median over runs of this set-up's tokens/s over the base's in the same run (the
    set-ups take turns, so a run's pair saw about the same machine); NaN without figures."""
    if not (level.has_figure() and base.has_figure()):
        return math.nan
    pairs = zip(level.tokens_per_s, base.tokens_per_s, strict=False)
    return statistics.median(x / y for x, y in pairs)


def best_setup(
    results: Mapping[tuple[str, int], Level], names: Sequence[str], c: int
) -> str | None:
    """Sluice's served set-up with the highest median tokens/s at ``c`` streams, of those
    with a figure."""
    served = [n for n in names if n in SLUICE_SERVED and results[n, c].has_figure()]
    return max(served, key=lambda n: statistics.median(results[n, c].tokens_per_s), default=None)


def judge(
    results: Mapping[tuple[str, int], Level],
    names: Sequence[str],
    setup: str | None,
    peer: str,
    c: int,
    missing: Mapping[str, str],
) -> tuple[float, str]:
    """Sluice's ``setup`` against ``peer`` at ``c`` streams: the paired ratio, and the
    verdict on it (PASS/MISS), or NaN and why there is none."""
    if peer in missing:
        return math.nan, f"n/a: {peer} {missing[peer]}"
    if peer not in names:
        return math.nan, f"n/a: {peer} not run"
    if (peer, c) not in results:
        return math.nan, f"n/a: {c} streams not run"
    if setup is None or setup not in names:
        return math.nan, "n/a: no Sluice set-up with a figure"
    for name in (setup, peer):
        if not results[name, c].has_figure():
            return math.nan, f"n/a: {name} stopped short"
    ratio = paired_ratio(results[setup, c], results[peer, c])
    return ratio, "**PASS**" if ratio >= TARGETS[peer, c] else "**MISS**"


def text_differences(texts: Sequence[str], reference: Sequence[str]) -> tuple[int, list[str]]:
    """How many texts equal the reference's, and where each other one first differs."""
    same, differences = 0, []
    for index, (text, wanted) in enumerate(zip(texts, reference, strict=False)):
        if text == wanted:
            same += 1
            continue
        at = next((i for i, (x, y) in enumerate(zip(text, wanted, strict=False)) if x != y), None)
        at = min(len(text), len(wanted)) if at is None else at
        differences.append(f"request {index} differs from character {at} on")
    return same, differences


def _median(values: Sequence[float]) -> float:
    known = [v for v in values if not math.isnan(v)]
    return statistics.median(known) if known else math.nan


def _ms(value: float) -> str:
    return "—" if math.isnan(value) else f"{value:.0f}"


def _cores(value: float) -> str:
    return "—" if math.isnan(value) else f"{value:.2f}"


def _ratio(value: float) -> str:
    return "—" if math.isnan(value) else f"{value:.2f}x"


def render(
    results: Mapping[tuple[str, int], Level],
    names: Sequence[str],
    levels: Sequence[int],
    peers: Sequence[str] = (),
    missing: Mapping[str, str] | None = None,
) -> Report:
    """The table of every set-up in ``names`` (Sluice's, then the ``peers`` that ran) at
    every level, then, when peers were asked for (run or ``missing``: set-up -> why not),
    the targets."""
    missing = missing or {}
    reference = names[0]
    base = BASE_SETUP if BASE_SETUP in names else reference
    ratio_columns = [n for n in (base, ENGINE_ALONE, *peers) if n in names]
    lines = [
        "| streams | set-up | output tok/s (median) | runs | TTFT p50 (ms) | CPU per token (ms) "
        + "".join(f"| / {n} " for n in ratio_columns)
        + f"| other jobs' cores (runs) | greedy texts = {reference} |",
        "|---|---|---|---|---|---|" + "---|" * (len(ratio_columns) + 2),
    ]
    problems: list[str] = []
    notes: list[str] = []
    for c in levels:
        for name in names:
            level = results[name, c]
            rate, spread = f"— ({level.num_short} short)", "—"
            if level.has_figure():
                rate = f"{statistics.median(level.tokens_per_s):,.0f}"
                spread = " / ".join(f"{x:,.0f}" for x in level.tokens_per_s)
            ratios = "".join(
                f"| {_ratio(paired_ratio(level, results[n, c]))} " for n in ratio_columns
            )
            same, differences = text_differences(level.texts, results[reference, c].texts)
            if same == len(results[reference, c].texts) == len(level.texts):
                equal = "yes"
            elif name in peers:
                equal = f"{same} of {len(level.texts)}"
                listed, more = (
                    differences[:MAX_DIFFERENCES_LISTED],
                    differences[MAX_DIFFERENCES_LISTED:],
                )
                notes += [f"{name}, {c} streams: {d}" for d in listed]
                if more:
                    notes.append(f"{name}, {c} streams: and {len(more)} more")
            else:
                equal = "NO"
                problems.append(f"{name}, {c} streams: greedy texts differ from {reference}'s")
            lines.append(
                f"| {c} | {name} | {rate} | {spread} "
                f"| {_ms(_median(level.ttft_p50_ms))} | {_median(level.cpu_ms_per_token):.2f} "
                f"{ratios}| {' / '.join(_cores(x) for x in level.other_cores)} | {equal} |"
            )
    lines += [f"{peer}: {reason}" for peer, reason in missing.items()]
    if peers or missing:
        lines += ["", *_target_lines(results, names, levels, missing)]
    return Report(lines, problems, notes)


def _busiest(
    results: Mapping[tuple[str, int], Level], names: Sequence[str | None], c: int
) -> float:
    """The most cores other jobs used in any run of these set-ups at ``c`` streams."""
    cores = [x for n in names if (n, c) in results for x in results[n, c].other_cores]
    return max((x for x in cores if not math.isnan(x)), default=0.0)


def _target_lines(
    results: Mapping[tuple[str, int], Level],
    names: Sequence[str],
    levels: Sequence[int],
    missing: Mapping[str, str],
) -> list[str]:
    lines = [
        "Targets (issue 15, served over HTTP; Sluice / peer output tok/s, paired within a run):",
        "",
        "| target | Sluice set-up | Sluice / peer | verdict |",
        "|---|---|---|---|",
    ]
    for (peer, c), target in TARGETS.items():
        what = "1 at a time" if c == 1 else f"{c} concurrent"
        best = best_setup(results, names, c) if c in levels else None
        for setup, role in ((DEFAULT_SETUP, "default"), (best, f"best at {c}")):
            ratio, verdict = judge(results, names, setup, peer, c, missing)
            busy = _busiest(results, [setup, peer], c)
            if not math.isnan(ratio) and busy > MAX_QUIET_CORES:
                verdict += f" (machine busy: other jobs {busy:.2f} cores)"
            lines.append(
                f"| {what} >= {target:.1f}x {peer} | {setup or '—'} ({role}) "
                f"| {_ratio(ratio)} | {verdict} |"
            )
    return lines
