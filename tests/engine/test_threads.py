"""ThreadGovernor: the engine's torch threads, tuned by timing its own steps.

A fake clock stands in for the machine: each test says what a step of decodes costs on
each thread count, and the governor must find the cheaper, hold it, try again after its
hold and follow a change of the machine. ``sluice serve`` runs it in the engine's child
process (``--engine-threads auto``, the default); the last test runs a real engine with it.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

from sluice.cli import build_parser
from sluice.engine.engine import Engine, EngineConfig
from sluice.engine.models import GPT2Config
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.threads import ThreadGovernor, cores_but_one, tuned_threads
from tests.engine.tiny_models import ascii_bytes, varied_gpt2


class Machine:
    """Thread counts as the governor sets them, and a step cost per thread count."""

    def __init__(self, cost_ms: dict[int, float]) -> None:
        self.cost_ms = cost_ms
        self.threads = 0
        self.sets: list[int] = []

    def set_threads(self, count: int) -> None:
        self.threads = count
        self.sets.append(count)

    def steps(
        self,
        governor: ThreadGovernor,
        count: int,
        *,
        prefill: Callable[[int], int] = lambda n: 0,
        decodes: Callable[[int], int] = lambda n: 8,
    ) -> list[int]:
        """Run ``count`` steps of ``decodes(n)`` decodes (and ``prefill(n)`` tokens of
        prefill) in step n, each costing ``cost_ms`` of its thread count; the thread count
        of each."""
        used = []
        for n in range(count):
            governor.before_step()
            used.append(self.threads)
            governor.after_step(prefill(n), decodes(n), self.cost_ms[self.threads] / 1e3)
        return used


def test_the_cheaper_count_wins_a_close_trial_and_holds() -> None:
    machine = Machine({1: 11.0, 2: 10.0})
    governor = ThreadGovernor((1, 2), set_threads=machine.set_threads, hold_steps=100)
    trial = machine.steps(governor, 32)
    assert trial == [1] * 8 + [2] * 16 + [1] * 8  # A B B A
    assert governor.threads == 2
    assert governor.num_trials == 1
    assert machine.steps(governor, 100) == [2] * 100
    assert machine.sets == [1, 2, 1, 2]  # set only when it changes


def test_a_decisive_first_half_ends_the_trial_there() -> None:
    machine = Machine({1: 16.8, 2: 24.0})  # two threads beside a busy process
    governor = ThreadGovernor((1, 2), set_threads=machine.set_threads, hold_steps=100)
    assert machine.steps(governor, 16) == [1] * 8 + [2] * 8
    assert governor.num_trials == 1
    assert governor.threads == 1
    assert machine.steps(governor, 100) == [1] * 100


def test_a_kept_count_holds_longer_and_a_change_starts_over() -> None:
    machine = Machine({1: 17.0, 2: 10.0})  # a quiet machine: two threads win
    governor = ThreadGovernor((1, 2), set_threads=machine.set_threads, hold_steps=50)
    machine.steps(governor, 16)  # the first trial finds 2
    assert (governor.threads, governor.hold) == (2, 50)
    machine.steps(governor, 50 + 16)  # the second keeps it: the hold doubles
    assert (governor.num_trials, governor.threads, governor.hold) == (2, 2, 100)
    machine.steps(governor, 100 + 16)
    machine.steps(governor, 200 + 16)
    machine.steps(governor, 400 + 16)
    assert (governor.num_trials, governor.hold) == (5, 400)  # at most 8 x 50
    machine.cost_ms = {1: 16.8, 2: 24.0}  # another process took a core: two threads lose
    used = machine.steps(governor, 400 + 16)
    assert used[-16:] == [1] * 8 + [2] * 8  # the trial after the hold
    assert (governor.num_trials, governor.threads, governor.hold) == (6, 1, 50)
    assert machine.steps(governor, 10) == [1] * 10


def test_a_trial_under_a_growing_load_decides_nothing_and_begins_again() -> None:
    machine = Machine({1: 10.0, 2: 10.0})  # a step costs the same on either count
    governor = ThreadGovernor((1, 2), set_threads=machine.set_threads, hold_steps=100)
    # Requests arrive: 1 sequence a step in block A, 64 from block B on. Per sequence, B
    # would look 64x cheaper.
    machine.steps(governor, 32, decodes=lambda n: 1 if n < 8 else 64)
    assert governor.num_inconclusive == 1
    assert governor.num_trials == 0
    assert governor.threads == 2  # unchanged
    used = machine.steps(governor, 32, decodes=lambda n: 64)  # the trial begun again
    assert used == [1] * 8 + [2] * 16 + [1] * 8
    assert governor.num_trials == 1


def test_steps_that_prefill_are_run_but_not_timed() -> None:
    machine = Machine({1: 17.0, 2: 10.0})
    governor = ThreadGovernor((1, 2), set_threads=machine.set_threads)
    machine.cost_ms = {1: 11.0, 2: 10.0}  # a close trial: all 32 counted steps
    # Every other step prefills, and would cost the one-thread blocks nothing if timed.
    used = machine.steps(governor, 62, prefill=lambda n: 512 * (n % 2))
    assert governor.num_trials == 0  # 31 timed steps: one short of the trial's 32
    assert used[:2] == [1, 1]  # a prefill step runs on the trial's current count
    machine.steps(governor, 2, prefill=lambda n: 0)
    assert governor.num_trials == 1
    assert governor.threads == 2


def test_one_candidate_is_set_once_and_never_tried() -> None:
    machine = Machine({3: 5.0})
    governor = ThreadGovernor((3, 3), set_threads=machine.set_threads)
    assert machine.steps(governor, 40) == [3] * 40
    assert machine.sets == [3]
    assert governor.num_trials == 0


def test_bad_candidates_and_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        ThreadGovernor(())
    with pytest.raises(ValueError, match="at least 1"):
        ThreadGovernor((0, 2))
    with pytest.raises(ValueError, match="block_steps"):
        ThreadGovernor((1, 2), block_steps=0)


def test_auto_tunes_between_the_cores_but_one_and_every_core() -> None:
    cores = len(os.sched_getaffinity(0))
    assert cores_but_one() == max(1, cores - 1)
    assert tuned_threads().candidates == tuple(sorted({max(1, cores - 1), cores}))


def test_engine_threads_is_auto_by_default_or_a_count() -> None:
    parser = build_parser()
    assert parser.parse_args(["serve"]).engine_threads is None
    assert parser.parse_args(["serve", "--engine-threads", "auto"]).engine_threads is None
    assert parser.parse_args(["serve", "--engine-threads", "2"]).engine_threads == 2
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--engine-threads", "0"])


def test_an_engine_with_a_governor_sets_the_threads_of_its_steps() -> None:
    config = GPT2Config(vocab_size=101, n_positions=128, n_embd=32, n_layer=2, n_head=2)
    engine = Engine(
        varied_gpt2(config),
        EngineConfig(
            num_blocks=64,
            block_size=4,
            max_num_seqs=4,
            max_num_batched_tokens=64,
            max_waiting=8,
            max_model_len=128,
        ),
        eos_token_id=None,
        token_bytes=ascii_bytes,
    )
    before = torch.get_num_threads()
    machine = Machine({})
    engine.threads = ThreadGovernor((1, 2), set_threads=machine.set_threads, block_steps=2)
    try:
        for i in range(3):
            engine.add_request([i + 1, i + 2], SamplingParams(max_tokens=20, temperature=0))
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        torch.set_num_threads(before)
    assert machine.sets[:2] == [1, 2]  # the trial's first block, then its second
    assert engine.threads.num_trials == 1  # 20 steps: 19 of decodes alone, 8 timed
    assert engine.threads.threads in (1, 2)
