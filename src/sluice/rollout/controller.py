"""Every alias's rollout in one place: routing, observations, decisions, the state file.

:class:`Rollouts` is what the server holds: the backend of an alias asks it which version
a new stream goes to (:meth:`Rollouts.choose`) and tells it how each stream went
(:meth:`Rollouts.observe`); the admin endpoints call :meth:`Rollouts.act`. Every decision
is handed to ``on_decision`` (metrics count them) and every decision that changes a state
or a weight is logged (``sluice.rollout``, INFO) and written to the state file before the
call returns, so a restart resumes where the rollout was (a rolled-back canary stays rolled
back). The analysis's holds are counted, not logged or written: one follows every canary
stream.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable

from sluice.errors import ConfigError, RolloutError
from sluice.rollout.analysis import Outcome
from sluice.rollout.config import ModelsConfig, VersionConfig
from sluice.rollout.state import Action, Decision, Rollout
from sluice.rollout.store import StateFile

__all__ = ["DecisionListener", "Rollouts"]

logger = logging.getLogger("sluice.rollout")

DecisionListener = Callable[[str, Decision], None]


class Rollouts:
    """The rollouts of a models config, restored from ``state_file`` when there is one."""

    def __init__(
        self,
        config: ModelsConfig,
        *,
        state_file: StateFile | None = None,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
        on_decision: DecisionListener | None = None,
    ) -> None:
        self.config = config
        self._state_file = state_file
        self._clock = clock
        self._rng = rng or random.Random()
        self.on_decision = on_decision
        now = clock()
        self._rollouts = {alias.name: Rollout(alias, now=now) for alias in config.aliases}
        if state_file is not None:
            self._restore(state_file)

    def _restore(self, state_file: StateFile) -> None:
        for name, record in state_file.load().items():
            rollout = self._rollouts.get(name)
            if rollout is None:
                logger.warning("rollout state of alias %r dropped: not in the models config", name)
                continue
            try:
                rollout.restore(record)
            except (ValueError, KeyError, TypeError) as exc:
                raise ConfigError(f"{state_file.path}: alias {name!r}: {exc}") from exc
            logger.info(
                "rollout of %r restored: %s, canary at %g%%",
                name,
                rollout.state.value,
                rollout.canary_weight,
                extra={"alias": name, "state": rollout.state.value},
            )

    @property
    def names(self) -> list[str]:
        return list(self._rollouts)

    def get(self, alias: str) -> Rollout:
        rollout = self._rollouts.get(alias)
        if rollout is None:
            known = ", ".join(self._rollouts)
            raise RolloutError(f"no alias {alias[:80]!r}; the models config has: {known}")
        return rollout

    def choose(self, alias: str, key: str | None) -> VersionConfig:
        """The version of ``alias`` a new stream with routing ``key`` goes to."""
        return self.get(alias).choose(key, self._rng)

    def observe(self, alias: str, outcome: Outcome) -> Decision | None:
        """A stream of ``alias`` ended; returns the decision it led to, if any."""
        decision = self.get(alias).observe(outcome, now=self._clock())
        if decision is not None:
            self._decided(alias, decision)
        return decision

    def act(self, alias: str, action: str, reason: str = "") -> Decision:
        """An admin's action on ``alias`` (``start``, ``pause``, ``promote``, ``rollback``)."""
        decision = self.get(alias).act(action, now=self._clock(), reason=reason)
        self._decided(alias, decision)
        return decision

    def _decided(self, alias: str, decision: Decision) -> None:
        if decision.action is not Action.HOLD:
            logger.info(
                "rollout of %r: %s by %s, canary %g%% -> %g%%, now %s: %s",
                alias,
                decision.action.value,
                decision.by,
                decision.from_weight,
                decision.to_weight,
                decision.state.value,
                decision.reason,
                extra={"alias": alias, "action": decision.action.value, "by": decision.by},
            )
            self.save()
        if self.on_decision is not None:
            self.on_decision(alias, decision)

    def save(self) -> None:
        """Write every rollout to the state file (when there is one)."""
        if self._state_file is not None:
            records = {name: rollout.record() for name, rollout in self._rollouts.items()}
            self._state_file.save(records)

    def describe(self) -> list[dict[str, object]]:
        """Every alias's rollout, JSON-ready."""
        return [rollout.describe() for rollout in self._rollouts.values()]
