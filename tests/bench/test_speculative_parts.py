"""``bench/speculative.py``'s verdict on "never slower than off": a row is slower only when
its runs are slower than off's beside them by a paired test, not when noise moves a median."""

from __future__ import annotations

import importlib
import math
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
# The benchmarks import each other as top-level modules, run from bench/.
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))

speculative = importlib.import_module("speculative")


def row(mode: str, tokens_per_s: list[float]) -> object:
    runs = [
        speculative.Run([], tps, 0.0, 0.0, 0.0, None)  # tokens, tokens/s, TTFT, ITL p50, p99
        for tps in tokens_per_s
    ]
    return speculative.Row("m", 0.0, 16, mode, runs)


def test_runs_each_slower_than_off_beside_them_are_slower() -> None:
    off = row("off", [4000, 3600, 4200, 3800, 4100])
    on = row("draft", [3600, 3300, 3750, 3450, 3700])  # 0.90x in every repetition
    assert speculative.paired_p_value(on, off) < 0.01


def test_noise_that_moves_the_median_is_not_slower() -> None:
    """Off's own spread (its third run 10% down) pulls on's median under off's, but on is
    not slower than the run beside it in most repetitions."""
    off = row("off", [4000, 3900, 3600, 4100, 4050])
    on = row("draft", [3800, 3950, 3700, 3800, 4080])
    assert on.median("tokens_per_s") / off.median("tokens_per_s") < 0.96
    assert speculative.paired_p_value(on, off) > 0.05


def test_fewer_than_three_repetitions_cannot_be_tested() -> None:
    assert math.isnan(speculative.paired_p_value(row("draft", [1, 2]), row("off", [2, 2])))
