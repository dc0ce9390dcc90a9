"""Every alias's rollout: decisions reach the listener and the state file, which a
restart reads back; the file is replaced atomically."""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

import pytest

from sluice.errors import ConfigError, RolloutError
from sluice.rollout.analysis import Outcome
from sluice.rollout.config import ModelsConfig, parse_models_config
from sluice.rollout.controller import Rollouts
from sluice.rollout.state import Action, Decision, RolloutState
from sluice.rollout.store import StateFile

CONFIG = """
[[alias]]
name = "assistant"
step_streams = 20
[[alias.version]]
name = "v1"
model = "words"
weight = 90
stable = true
[[alias.version]]
name = "v2"
model = "words"
weight = 10

[[alias]]
name = "plain"
rollout = "manual"
[[alias.version]]
name = "only"
model = "words"
weight = 100
stable = true
"""


def config() -> ModelsConfig:
    return parse_models_config(tomllib.loads(CONFIG))


def test_decisions_are_saved_and_survive_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.json"
    seen: list[tuple[str, Decision]] = []
    rollouts = Rollouts(config(), state_file=StateFile(path), clock=lambda: 5.0)
    rollouts.on_decision = lambda alias, decision: seen.append((alias, decision))
    for _ in range(300):
        rollouts.observe("assistant", Outcome(canary=False, ttft_s=0.1))
    while rollouts.get("assistant").state is RolloutState.RUNNING:
        rollouts.observe("assistant", Outcome(canary=True, failed=True))
    actions = [decision.action for _, decision in seen]
    assert actions[-1] is Action.ROLL_BACK
    assert set(actions[:-1]) == {Action.HOLD}
    saved = json.loads(path.read_text())
    assert saved["rollouts"]["assistant"]["state"] == "rolled_back"

    again = Rollouts(config(), state_file=StateFile(path))
    restored = again.get("assistant")
    assert restored.state is RolloutState.ROLLED_BACK
    assert restored.weights() == {"v1": 100, "v2": 0}
    assert restored.last is not None
    assert restored.last.action is Action.ROLL_BACK
    assert restored.evidence.counts() == rollouts.get("assistant").evidence.counts()


def test_admin_action_is_saved_and_unknown_alias_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.json"
    rollouts = Rollouts(config(), state_file=StateFile(path))
    rollouts.act("assistant", "promote")
    assert json.loads(path.read_text())["rollouts"]["assistant"]["canary_weight"] == 25
    with pytest.raises(RolloutError, match="no alias 'nope'"):
        rollouts.act("nope", "promote")
    with pytest.raises(RolloutError, match="'plain' is stable: cannot"):
        rollouts.act("plain", "rollback")
    assert [item["alias"] for item in rollouts.describe()] == ["assistant", "plain"]


def test_missing_file_is_a_fresh_start_and_a_foreign_one_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.json"
    assert Rollouts(config(), state_file=StateFile(path)).get("assistant").canary_weight == 10
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not a rollout state file"):
        Rollouts(config(), state_file=StateFile(path))
    path.write_text(json.dumps({"format": 1, "rollouts": {"assistant": {"versions": ["x"]}}}))
    with pytest.raises(ConfigError, match="alias 'assistant': the state file's versions"):
        Rollouts(config(), state_file=StateFile(path))


def test_state_of_an_alias_no_longer_configured_is_dropped(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.json"
    path.write_text(json.dumps({"format": 1, "rollouts": {"gone": {"state": "running"}}}))
    rollouts = Rollouts(config(), state_file=StateFile(path))
    rollouts.save()
    assert set(json.loads(path.read_text())["rollouts"]) == {"assistant", "plain"}


def test_save_replaces_the_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.json"
    store = StateFile(path)
    store.save({"a": {"n": 1}})
    inode = os.stat(path).st_ino
    store.save({"a": {"n": 2}})
    assert store.load() == {"a": {"n": 2}}
    assert os.stat(path).st_ino != inode  # a new file renamed over the old one
    assert os.listdir(tmp_path) == ["rollouts.json"]


def test_failed_write_keeps_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.json"
    store = StateFile(path)
    store.save({"a": {"n": 1}})
    with pytest.raises(TypeError):
        store.save({"a": {"n": object()}})  # not JSON: fails before anything is replaced
    assert store.load() == {"a": {"n": 1}}
    assert os.listdir(tmp_path) == ["rollouts.json"]
