"""The job an engine peer is given and the result it hands back, as JSON files.

``bench/engine_throughput.py --peers`` writes a :class:`Job` (the prompts as token ids, the
same for every engine) and runs a peer's runner (``vllm_runner.py``, ``llama_cpp_runner.py``)
with that peer's own Python, in its own venv under ``.peers/``; the runner writes a
:class:`PeerResult`, which the bench reads back with :func:`parse_result` (it checks every
field, so a runner that printed something else is a stated failure, not a crash).

Standard library only: every peer's venv imports this file (runners import it as a sibling).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ForeignCpu",
    "Job",
    "PeerResult",
    "Phase",
    "ResultError",
    "make_phase",
    "parse_result",
    "percentile",
    "run_runner",
]


@dataclass(frozen=True)
class Job:
    """What every peer runs: ``prompts`` all at once, then the first ``num_sequential`` of
    them one at a time; greedy, EOS ignored, ``output_tokens`` each."""

    model: str  # the peer's own copy of the bench's model: a directory or a .gguf file
    prompts: list[list[int]]
    output_tokens: int
    num_sequential: int
    threads: int
    max_model_len: int

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Job:
        return cls(**json.loads(text))


@dataclass(frozen=True)
class Phase:
    """One way of running the prompts: output tokens/s over the whole phase, time to first
    token from submission (p50/p99; None where the engine does not tell), and the greedy token
    ids of every prompt in order."""

    tokens_per_s: float
    elapsed_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    completions: list[list[int]]
    foreign_cores: float | None = None  # ForeignCpu over the phase, where Linux tells


@dataclass(frozen=True)
class PeerResult:
    engine: str  # name and version, as the runner found them
    batch: Phase  # every prompt at once
    one_sequence: Phase  # the first num_sequential prompts, one at a time
    notes: list[str]  # what the runner wants said beside its figures

    def to_json(self) -> str:
        return json.dumps(asdict(self))


class ForeignCpu:
    """How many cores' worth of CPU the rest of the machine used over a stretch of wall time:
    all the CPU time ``/proc/stat`` counts, less this process's and its descendants'
    (``/proc/<pid>/stat``, children found through ``/proc/<pid>/task/*/children``).

    Other jobs share these 2 cores, and an engine whose threads spin (llama.cpp's and vLLM's
    OpenMP threads) loses far more than its share to them: near 0, a figure was taken alone;
    0.5 or more, it was not. A descendant that exits before the end takes its CPU time with
    it (counted as foreign), so read it over a stretch in which the engine's processes live.
    None where ``/proc`` is not Linux's."""

    STAT = Path("/proc/stat")
    PROC = Path("/proc")

    def __init__(self, pid: int | None = None) -> None:
        self._pid = os.getpid() if pid is None else pid
        self._start = self._read()

    def _ticks(self, pid: int) -> int:
        fields = (self.PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime, stime

    def _tree_ticks(self) -> int:
        total, pending = 0, [self._pid]
        while pending:
            pid = pending.pop()
            try:
                total += self._ticks(pid)
                for task in (self.PROC / str(pid) / "task").iterdir():
                    pending += [int(c) for c in (task / "children").read_text().split()]
            except (OSError, ValueError, IndexError):
                continue  # exited meanwhile
        return total

    def _read(self) -> tuple[int, int, float] | None:
        try:
            cpu = [int(f) for f in self.STAT.read_text().splitlines()[0].split()[1:9]]
        except (OSError, ValueError):
            return None
        busy = sum(cpu) - cpu[3] - cpu[4]  # all but idle and iowait
        return busy, self._tree_ticks(), time.monotonic()

    def cores(self) -> float | None:
        """Since this meter was made."""
        end = self._read()
        if end is None or self._start is None or end[2] <= self._start[2]:
            return None
        ticks = (end[0] - self._start[0]) - (end[1] - self._start[1])
        return max(0.0, ticks / os.sysconf("SC_CLK_TCK") / (end[2] - self._start[2]))


class ResultError(ValueError):
    """A runner's output that is not a valid result for its job."""


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (as ``bench/engine_throughput.py``)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def make_phase(
    completions: list[list[int]],
    elapsed_s: float,
    ttft_s: Sequence[float | None],
    foreign: ForeignCpu | None = None,
) -> Phase:
    """A phase's figures; its TTFT is None unless every request's is known."""
    made = sum(len(c) for c in completions)
    known = [t for t in ttft_s if t is not None]
    whole = bool(known) and len(known) == len(ttft_s)
    return Phase(
        tokens_per_s=made / elapsed_s,
        elapsed_s=elapsed_s,
        ttft_p50_s=percentile(known, 50) if whole else None,
        ttft_p99_s=percentile(known, 99) if whole else None,
        completions=completions,
        foreign_cores=None if foreign is None else foreign.cores(),
    )


def _number(raw: dict[str, Any], key: str, where: str) -> float:
    value = raw.get(key)
    return _checked(value, key, where)


def _optional_number(raw: dict[str, Any], key: str, where: str) -> float | None:
    value = raw.get(key)
    return None if value is None else _checked(value, key, where)


def _checked(value: object, key: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ResultError(f"{where}.{key}: expected a finite number, got {value!r}")
    if value < 0:
        raise ResultError(f"{where}.{key}: negative ({value})")
    return float(value)


def _phase(raw: object, where: str, num_prompts: int, output_tokens: int) -> Phase:
    if not isinstance(raw, dict):
        raise ResultError(f"{where}: expected an object, got {type(raw).__name__}")
    completions = raw.get("completions")
    if not isinstance(completions, list) or len(completions) != num_prompts:
        count = len(completions) if isinstance(completions, list) else completions
        raise ResultError(f"{where}.completions: expected {num_prompts} lists, got {count!r}")
    for index, tokens in enumerate(completions):
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens
        ):
            raise ResultError(f"{where}.completions[{index}]: expected a list of token ids")
        if len(tokens) != output_tokens:
            raise ResultError(
                f"{where}.completions[{index}]: {len(tokens)} tokens, expected {output_tokens}"
            )
    tokens_per_s = _number(raw, "tokens_per_s", where)
    if tokens_per_s == 0:
        raise ResultError(f"{where}.tokens_per_s: zero")
    return Phase(
        tokens_per_s=tokens_per_s,
        elapsed_s=_number(raw, "elapsed_s", where),
        ttft_p50_s=_optional_number(raw, "ttft_p50_s", where),
        ttft_p99_s=_optional_number(raw, "ttft_p99_s", where),
        completions=completions,
        foreign_cores=_optional_number(raw, "foreign_cores", where),
    )


def parse_result(text: str, job: Job) -> PeerResult:
    """``text`` as the result of ``job``; :class:`ResultError` says what is wrong with it."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ResultError(f"not JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ResultError(f"expected an object, got {type(raw).__name__}")
    engine = raw.get("engine")
    if not isinstance(engine, str) or not engine:
        raise ResultError(f"engine: expected a name, got {engine!r}")
    notes = raw.get("notes", [])
    if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
        raise ResultError("notes: expected a list of strings")
    num_sequential = min(job.num_sequential, len(job.prompts))
    return PeerResult(
        engine=engine,
        batch=_phase(raw.get("batch"), "batch", len(job.prompts), job.output_tokens),
        one_sequence=_phase(
            raw.get("one_sequence"), "one_sequence", num_sequential, job.output_tokens
        ),
        notes=notes,
    )


def run_runner(run: Callable[[Job], PeerResult], argv: Sequence[str] | None = None) -> int:
    """A runner's ``main``: ``runner.py JOB.json RESULT.json``; the traceback goes to stderr
    (the bench keeps the end of it) and the exit status says whether a result was written."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: runner.py JOB.json RESULT.json", file=sys.stderr)
        return 2
    job = Job.from_json(Path(args[0]).read_text())
    try:
        result = run(job)
    except Exception:
        traceback.print_exc()
        return 1
    Path(args[1]).write_text(result.to_json())
    return 0
