"""The engine peers' lines in ``bench/engine_throughput.py``'s report: figures, the issue's
targets against them, and whether their greedy output equals ours.

The targets (issue 15): all at once, ours >= 1.0x vLLM CPU (and >= 1.5x ``transformers``'
static batch, judged by the bench itself); one sequence, ours >= 0.5x llama.cpp. A greedy
completion that differs from ours is listed with the first position where it does; it is
not a failure of the run (the peers' kernels round differently), only a fact to look at.
Standard library only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine_peers.launcher import PeerOutcome
from engine_peers.protocol import Phase

__all__ = ["TARGETS", "OursFigures", "greedy_agreement", "peer_rows", "summary_table"]

# (peer name, phase) -> the least ours / peer output tokens/s the issue asks for.
TARGETS = {("vllm", "batch"): 1.0, ("llama.cpp", "one_sequence"): 0.5}

Row = tuple[str, str, str]  # metric, value, target (as the bench's table)


@dataclass(frozen=True)
class OursFigures:
    """What the bench measured of ours and of ``transformers``, to put beside the peers."""

    batch_tokens_per_s: float
    one_sequence_tokens_per_s: float
    hf_batch_tokens_per_s: float
    batch_completions: list[list[int]]
    one_sequence_completions: list[list[int]]
    batch_foreign_cores: float | None = None  # other jobs' cores meanwhile (ForeignCpu)
    one_sequence_foreign_cores: float | None = None
    hf_batch_foreign_cores: float | None = None


def greedy_agreement(
    ours: Sequence[Sequence[int]], theirs: Sequence[Sequence[int]]
) -> tuple[int, list[str]]:
    """How many completions are equal, and for each that is not, where it first differs."""
    same = 0
    differences = []
    for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if list(a) == list(b):
            same += 1
            continue
        at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        at = min(len(a), len(b)) if at is None else at
        differences.append(f"completion {index} differs from token {at} on")
    return same, differences


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.0f}"


def _ratio_row(peer_name: str, label: str, phase: str, ours: float, theirs: float) -> Row:
    ratio = ours / theirs
    what = "all at once" if phase == "batch" else "one sequence"
    target = TARGETS.get((peer_name, phase))
    verdict = "" if target is None else f">= {target:.1f}x: {'PASS' if ratio >= target else 'MISS'}"
    return (f"ours / {label}, {what}", f"{ratio:.2f}x", verdict)


def peer_rows(outcomes: Sequence[PeerOutcome], ours: OursFigures) -> tuple[list[Row], list[str]]:
    """The table rows of every peer, and notes to print under it (mismatches, failures)."""
    rows: list[Row] = []
    notes: list[str] = []
    for outcome in outcomes:
        peer, result = outcome.peer, outcome.result
        if result is None:
            first_line, _, rest = outcome.reason.partition("\n")
            rows.append((peer.label, first_line, ""))
            if rest:
                notes.append(f"{peer.label}: {outcome.reason}")
            continue
        batch, single = result.batch, result.one_sequence
        rows += [
            (f"output tokens/s, {peer.label}", f"{batch.tokens_per_s:.0f}", ""),
            (f"output tokens/s, {peer.label} one sequence", f"{single.tokens_per_s:.0f}", ""),
            (f"TTFT p50 / p99 under load, {peer.label} (ms)", _ttft(batch), ""),
            _ratio_row(peer.name, peer.label, "batch", ours.batch_tokens_per_s, batch.tokens_per_s),
            _ratio_row(
                peer.name,
                peer.label,
                "one_sequence",
                ours.one_sequence_tokens_per_s,
                single.tokens_per_s,
            ),
        ]
        for what, mine, theirs in (
            ("", ours.batch_completions, batch.completions),
            (" one sequence", ours.one_sequence_completions, single.completions),
        ):
            same, differences = greedy_agreement(mine, theirs)
            rows.append(
                (f"greedy completions equal to {peer.label}{what}", f"{same} of {len(mine)}", "")
            )
            notes += [f"{peer.label}{what}: {d}" for d in differences]
        notes += [f"{peer.label}: {note}" for note in [result.engine, *result.notes]]
    return rows, notes


def _cores(cores: float | None) -> str:
    return "-" if cores is None else f"{cores:.2f}"


def _ttft(phase: Phase) -> str:
    return f"{_ms(phase.ttft_p50_s)} / {_ms(phase.ttft_p99_s)}"


def summary_table(outcomes: Sequence[PeerOutcome], ours: OursFigures, num_requests: int) -> str:
    """Output tokens/s side by side: ours, each peer, ``transformers``' static batch."""
    labels = [o.peer.label for o in outcomes]
    head = ["workload, output tokens/s", "Sluice", *labels, "HF static batch"]

    def cell(outcome: PeerOutcome, batch: bool) -> str:
        if outcome.result is None:
            return "n/a"
        phase = outcome.result.batch if batch else outcome.result.one_sequence
        return f"{phase.tokens_per_s:,.0f}"

    def foreign(outcome: PeerOutcome) -> str:
        if outcome.result is None:
            return "n/a"
        return f"{_cores(outcome.result.batch.foreign_cores)} / " + _cores(
            outcome.result.one_sequence.foreign_cores
        )

    lines = [
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        "| "
        + " | ".join(
            [
                f"in-process, {num_requests} at once",
                f"{ours.batch_tokens_per_s:,.0f}",
                *(cell(o, True) for o in outcomes),
                f"{ours.hf_batch_tokens_per_s:,.0f}",
            ]
        )
        + " |",
        "| "
        + " | ".join(
            [
                "in-process, one sequence",
                f"{ours.one_sequence_tokens_per_s:,.0f}",
                *(cell(o, False) for o in outcomes),
                "-",
            ]
        )
        + " |",
        "| "
        + " | ".join(
            [
                "other jobs' cores meanwhile (at once / one)",
                f"{_cores(ours.batch_foreign_cores)} / " + _cores(ours.one_sequence_foreign_cores),
                *(foreign(o) for o in outcomes),
                _cores(ours.hf_batch_foreign_cores),
            ]
        )
        + " |",
    ]
    return "\n".join(lines)
