"""One alias's rollout: its state, the canary's weight, the evidence and the decisions.

The states and what moves between them are one table (:data:`TRANSITIONS`); an action the
table does not allow raises :class:`~sluice.errors.RolloutError` naming the state::

    state        start     pause    step     complete   roll_back    hold
    running      -         paused   running  promoted   rolled_back  running
    paused       running   -        paused   promoted   rolled_back  -
    rolled_back  running   -        -        -          -            -
    promoted     -         -        -        -          rolled_back  -
    stable       -         -        -        -          -            -

``step`` raises the canary's weight to the next of the alias's steps and ``complete`` to
100 (the public ``promote`` is whichever of the two the next step is); ``roll_back`` sets
it to 0 at once (streams already on the canary finish there); ``start`` from
``rolled_back`` begins again at the configured weight with fresh evidence. ``hold`` is the
analysis's "not yet". An alias with one version is ``stable`` and does nothing. A
``manual`` alias starts ``paused`` and cannot be started: only an admin moves it. An
``auto`` alias starts ``running``, and after each of its canary's streams the analysis's
verdict (:mod:`sluice.rollout.analysis`) becomes a decision.
"""

from __future__ import annotations

import enum
import random
from collections import deque
from dataclasses import dataclass
from typing import Final

from sluice.errors import RolloutError
from sluice.rollout.analysis import Evidence, Outcome, Verdict
from sluice.rollout.assignment import in_canary
from sluice.rollout.config import AliasConfig, RolloutMode, VersionConfig
from sluice.rollout.recent import RecentStreams

__all__ = [
    "MAX_DECISIONS",
    "TRANSITIONS",
    "Action",
    "Decision",
    "Rollout",
    "RolloutState",
]

# Decisions (and weight changes) kept per alias for the API and the dashboard.
MAX_DECISIONS: Final = 200


class RolloutState(enum.StrEnum):
    RUNNING = "running"
    PAUSED = "paused"
    ROLLED_BACK = "rolled_back"
    PROMOTED = "promoted"
    STABLE = "stable"


class Action(enum.StrEnum):
    START = "start"
    PAUSE = "pause"
    STEP = "step"
    COMPLETE = "complete"
    ROLL_BACK = "roll_back"
    HOLD = "hold"


_S, _A = RolloutState, Action
TRANSITIONS: Final[dict[tuple[RolloutState, Action], RolloutState]] = {
    (_S.RUNNING, _A.PAUSE): _S.PAUSED,
    (_S.RUNNING, _A.STEP): _S.RUNNING,
    (_S.RUNNING, _A.COMPLETE): _S.PROMOTED,
    (_S.RUNNING, _A.ROLL_BACK): _S.ROLLED_BACK,
    (_S.RUNNING, _A.HOLD): _S.RUNNING,
    (_S.PAUSED, _A.START): _S.RUNNING,
    (_S.PAUSED, _A.STEP): _S.PAUSED,
    (_S.PAUSED, _A.COMPLETE): _S.PROMOTED,
    (_S.PAUSED, _A.ROLL_BACK): _S.ROLLED_BACK,
    (_S.ROLLED_BACK, _A.START): _S.RUNNING,
    (_S.PROMOTED, _A.ROLL_BACK): _S.ROLLED_BACK,
}


@dataclass(frozen=True, slots=True)
class Decision:
    """One decision: what was done, by whom (``auto`` or ``admin``), the weights, and why."""

    at: float  # unix seconds
    action: Action
    by: str
    state: RolloutState
    from_weight: float
    to_weight: float
    reason: str

    def describe(self) -> dict[str, object]:
        return {
            "at": self.at,
            "action": self.action.value,
            "by": self.by,
            "state": self.state.value,
            "from_weight": self.from_weight,
            "to_weight": self.to_weight,
            "reason": self.reason,
        }


class Rollout:
    """The live rollout of one alias (see the module doc)."""

    def __init__(self, alias: AliasConfig, *, now: float, num_lanes: int = 1) -> None:
        self.alias = alias
        self.evidence = Evidence(alias.analysis, num_lanes)
        canary = alias.canary
        self.canary_weight = 0.0 if canary is None else canary.weight
        if canary is None:
            self.state = RolloutState.STABLE
        elif alias.mode is RolloutMode.MANUAL:
            self.state = RolloutState.PAUSED
        else:
            self.state = RolloutState.RUNNING
        self.decisions: deque[Decision] = deque(maxlen=MAX_DECISIONS)
        self.last: Decision | None = None  # the latest, holds included
        self.num_holds = 0
        self.created = now
        self.recent = {version.name: RecentStreams() for version in alias.versions}

    # -- routing --------------------------------------------------------------------------

    def choose(self, key: str | None, rng: random.Random) -> VersionConfig:
        """The version a new stream with routing ``key`` goes to now."""
        canary = self.alias.canary
        if canary is not None and in_canary(self.alias.name, key, self.canary_weight, rng):
            return canary
        return self.alias.stable

    # -- decisions ------------------------------------------------------------------------

    def observe(self, outcome: Outcome, *, now: float) -> Decision | None:
        """Count a finished stream; after a canary stream of a running rollout, decide."""
        canary = self.alias.canary
        version = canary if outcome.canary and canary is not None else self.alias.stable
        self.recent[version.name].add(outcome)
        if self.state in (RolloutState.STABLE, RolloutState.PROMOTED):
            return None  # nothing left to compare
        self.evidence.observe(outcome)
        if not outcome.canary or self.state is not RolloutState.RUNNING:
            return None
        verdict, reason = self.evidence.verdict()
        if verdict is Verdict.ROLL_BACK:
            return self._apply(Action.ROLL_BACK, "auto", reason, now)
        if verdict is Verdict.PROMOTE:
            return self._apply(self._promotion(), "auto", reason, now)
        self.num_holds += 1
        self.last = Decision(
            now, Action.HOLD, "auto", self.state, self.canary_weight, self.canary_weight, reason
        )
        return self.last

    def act(self, action: str, *, now: float, reason: str = "") -> Decision:
        """An admin's ``start``, ``pause``, ``promote`` or ``rollback``."""
        names = {
            "start": Action.START,
            "pause": Action.PAUSE,
            "promote": None,
            "rollback": Action.ROLL_BACK,
        }
        if action not in names:
            raise RolloutError(
                f"unknown action {action[:40]!r}; use start, pause, promote or rollback"
            )
        chosen = names[action] or self._promotion()
        if chosen is Action.START and self.alias.mode is RolloutMode.MANUAL:
            raise RolloutError(
                f'alias {self.alias.name!r} is rolled out by hand (rollout = "manual"): '
                "use promote or rollback"
            )
        return self._apply(chosen, "admin", reason or f"{action} by an admin", now)

    def _promotion(self) -> Action:
        steps = self.alias.analysis.steps
        following = [step for step in steps if step > self.canary_weight]
        return Action.STEP if following and following[0] < 100 else Action.COMPLETE

    def _apply(self, action: Action, by: str, reason: str, now: float) -> Decision:
        target = TRANSITIONS.get((self.state, action))
        if target is None:
            raise RolloutError(
                f"alias {self.alias.name!r} is {self.state.value}: cannot {action.value}"
            )
        before = self.canary_weight
        if action is Action.ROLL_BACK:
            self.canary_weight = 0.0
        elif action is Action.COMPLETE:
            self.canary_weight = 100.0
        elif action is Action.STEP:
            following = [step for step in self.alias.analysis.steps if step > before]
            self.canary_weight = following[0]
        elif action is Action.START and self.state is RolloutState.ROLLED_BACK:
            canary = self.alias.canary
            self.canary_weight = 0.0 if canary is None else canary.weight
            self.evidence = Evidence(self.alias.analysis, self.evidence.num_lanes)
        if self.canary_weight != before:
            self.evidence.new_step()
        self.state = target
        decision = Decision(now, action, by, target, before, self.canary_weight, reason)
        self.decisions.append(decision)
        self.last = decision
        return decision

    # -- reports and persistence ----------------------------------------------------------

    def weights(self) -> dict[str, float]:
        """Each version's weight now, in percent."""
        canary = self.alias.canary
        if canary is None:
            return {self.alias.stable.name: 100.0}
        return {self.alias.stable.name: 100 - self.canary_weight, canary.name: self.canary_weight}

    def describe(self) -> dict[str, object]:
        """The alias's rollout, JSON-ready (``GET /v1/admin/rollouts``)."""
        alias = self.alias
        return {
            "alias": alias.name,
            "mode": alias.mode.value,
            "state": self.state.value,
            "stable": alias.stable.name,
            "canary": None if alias.canary is None else alias.canary.name,
            "weights": self.weights(),
            "versions": {
                version.name: {"model": version.model, **self.recent[version.name].describe()}
                for version in alias.versions
            },
            "steps": list(alias.analysis.steps),
            "false_alarm_rate": alias.analysis.false_alarm_rate,
            "evidence": self.evidence.summary(),
            "holds": self.num_holds,
            "last_decision": None if self.last is None else self.last.describe(),
            "decisions": [decision.describe() for decision in self.decisions],
        }

    def record(self) -> dict[str, object]:
        """What the state file keeps of this rollout."""
        return {
            "versions": [version.name for version in self.alias.versions],
            "state": self.state.value,
            "canary_weight": self.canary_weight,
            "evidence": self.evidence.counts(),
            "decisions": [decision.describe() for decision in self.decisions],
        }

    def restore(self, record: dict[str, object]) -> None:
        """Take back a :meth:`record`; raises ``ValueError`` (or ``KeyError``, ``TypeError``)
        on a record of other versions or of a bad shape, leaving this rollout unchanged."""
        names = [version.name for version in self.alias.versions]
        if record.get("versions") != names:
            raise ValueError(f"the state file's versions {record.get('versions')} are not {names}")
        state = RolloutState(str(record["state"]))
        weight = record["canary_weight"]
        if not isinstance(weight, int | float) or not 0 <= weight <= 100:
            raise ValueError(f"canary_weight {weight!r} is not in [0, 100]")
        evidence = record["evidence"]
        decisions = record["decisions"]
        if not isinstance(evidence, dict) or not isinstance(decisions, list):
            raise TypeError("evidence must be an object and decisions an array")
        restored = Evidence(self.alias.analysis, self.evidence.num_lanes)
        restored.restore(evidence["judged"], evidence["bad"], int(evidence["step_streams"]))
        kept = [_decision(item) for item in decisions[-MAX_DECISIONS:]]
        self.state, self.canary_weight, self.evidence = state, float(weight), restored
        self.decisions = deque(kept, maxlen=MAX_DECISIONS)
        self.last = kept[-1] if kept else None


def _decision(item: object) -> Decision:
    if not isinstance(item, dict):
        raise TypeError("a decision must be an object")
    return Decision(
        at=float(item["at"]),
        action=Action(item["action"]),
        by=str(item["by"]),
        state=RolloutState(item["state"]),
        from_weight=float(item["from_weight"]),
        to_weight=float(item["to_weight"]),
        reason=str(item["reason"]),
    )
