"""One alias's rollout: the state table, promotions step by step, rollback, decisions."""

from __future__ import annotations

import random
import tomllib

import pytest

from sluice.errors import RolloutError
from sluice.rollout.analysis import Outcome
from sluice.rollout.config import AliasConfig, parse_models_config
from sluice.rollout.state import TRANSITIONS, Action, Rollout, RolloutState

CONFIG = """
[[alias]]
name = "assistant"
rollout = "{mode}"
step_streams = 20

[[alias.version]]
name = "v1"
model = "words"
weight = 95
stable = true

[[alias.version]]
name = "v2"
model = "words"
weight = 5
"""


def alias(mode: str = "auto") -> AliasConfig:
    return parse_models_config(tomllib.loads(CONFIG.format(mode=mode))).aliases[0]


def feed(rollout: Rollout, *, stable: int, canary: int, failed: bool = False) -> list[Action]:
    """Stable streams, then canary streams; the actions of the decisions they led to."""
    actions = []
    for _ in range(stable):
        rollout.observe(Outcome(canary=False, ttft_s=0.1), now=1.0)
    for _ in range(canary):
        decision = rollout.observe(Outcome(canary=True, failed=failed, ttft_s=0.1), now=2.0)
        if decision is not None and decision.action is not Action.HOLD:
            actions.append(decision.action)
    return actions


def test_table_has_no_way_out_of_stable() -> None:
    assert not any(state is RolloutState.STABLE for state, _ in TRANSITIONS)


def test_good_canary_is_promoted_step_by_step_to_completion() -> None:
    rollout = Rollout(alias(), now=0.0)
    assert rollout.state is RolloutState.RUNNING
    actions = feed(rollout, stable=500, canary=100)
    assert actions == [Action.STEP, Action.STEP, Action.COMPLETE]
    assert [d.to_weight for d in rollout.decisions] == [25, 50, 100]
    assert rollout.state is RolloutState.PROMOTED
    assert rollout.weights() == {"v1": 0, "v2": 100}
    assert all(d.by == "auto" for d in rollout.decisions)


def test_failing_canary_is_rolled_back_and_its_keys_go_to_stable() -> None:
    rollout = Rollout(alias(), now=0.0)
    rng = random.Random(0)
    canary_keys = [f"u{n}" for n in range(2000) if rollout.choose(f"u{n}", rng).name == "v2"]
    assert canary_keys
    actions = feed(rollout, stable=500, canary=20, failed=True)
    assert actions == [Action.ROLL_BACK]
    assert rollout.state is RolloutState.ROLLED_BACK
    assert rollout.last is not None
    assert rollout.last.reason.startswith("error: ")
    assert {rollout.choose(key, rng).name for key in canary_keys} == {"v1"}
    # A rolled-back canary stays rolled back: its streams no longer decide anything.
    assert feed(rollout, stable=0, canary=50) == []


def test_holds_are_counted_but_not_kept_as_decisions() -> None:
    rollout = Rollout(alias(), now=0.0)
    feed(rollout, stable=200, canary=5)
    assert rollout.num_holds == 5
    assert not rollout.decisions
    assert rollout.last is not None
    assert rollout.last.action is Action.HOLD


def test_admin_actions_follow_the_table() -> None:
    rollout = Rollout(alias(), now=0.0)
    assert rollout.act("pause", now=1.0).state is RolloutState.PAUSED
    feed(rollout, stable=200, canary=100)  # paused: no automatic decision
    assert not [d for d in rollout.decisions if d.by == "auto"]
    step = rollout.act("promote", now=2.0)
    assert (step.action, step.to_weight, step.state) == (Action.STEP, 25, RolloutState.PAUSED)
    with pytest.raises(RolloutError, match="'assistant' is paused: cannot pause"):
        rollout.act("pause", now=3.0)
    assert rollout.act("start", now=3.0).state is RolloutState.RUNNING
    back = rollout.act("rollback", now=4.0, reason="bad answers")
    assert (back.to_weight, back.reason, back.by) == (0, "bad answers", "admin")
    with pytest.raises(RolloutError, match="cannot roll_back"):
        rollout.act("rollback", now=5.0)
    again = rollout.act("start", now=6.0)  # starts over at the configured weight
    assert (again.to_weight, again.state) == (5, RolloutState.RUNNING)
    assert rollout.evidence.judged.sum() == 0
    with pytest.raises(RolloutError, match="unknown action 'explode'"):
        rollout.act("explode", now=7.0)


def test_manual_alias_waits_for_an_admin() -> None:
    rollout = Rollout(alias("manual"), now=0.0)
    assert rollout.state is RolloutState.PAUSED
    assert feed(rollout, stable=300, canary=300, failed=True) == []
    with pytest.raises(RolloutError, match="rolled out by hand"):
        rollout.act("start", now=1.0)
    assert rollout.act("promote", now=1.0).to_weight == 25


def test_record_round_trips_and_refuses_other_versions() -> None:
    rollout = Rollout(alias(), now=0.0)
    feed(rollout, stable=500, canary=20)
    rollout.act("pause", now=3.0)
    record = rollout.record()
    copy = Rollout(alias(), now=0.0)
    copy.restore(record)
    kept = ("state", "weights", "decisions", "last_decision")
    assert {k: copy.describe()[k] for k in kept} == {k: rollout.describe()[k] for k in kept}
    assert copy.evidence.counts() == rollout.evidence.counts()
    with pytest.raises(ValueError, match="versions"):
        copy.restore({**record, "versions": ["v1", "v3"]})
    with pytest.raises(ValueError, match="canary_weight"):
        copy.restore({**record, "canary_weight": 101})
    assert copy.state is RolloutState.PAUSED  # unchanged by the refused records
