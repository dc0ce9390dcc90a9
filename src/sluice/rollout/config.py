"""The models config (``sluice serve --models-config FILE``): public aliases and their versions.

A TOML file of ``[[alias]]`` tables, each with ``[[alias.version]]`` tables::

    [[alias]]
    name = "assistant"          # the public model name clients ask for
    rollout = "auto"            # or "manual": weights only, no automatic decisions
    steps = [5, 25, 50, 100]    # optional (auto): the canary's weights, step by step
    step_streams = 200          # optional (auto): canary streams at a step before promoting
    false_alarm_rate = 0.01     # optional (auto): chance an equal canary is rolled back
    effect = 2.0                # optional (auto): the ratio of bad-stream rates to detect

    [[alias.version]]
    name = "v1"
    model = "words"             # a served model: a checkpoint, an upstream model, ``words``
    weight = 95                 # percent of the alias's streams
    stable = true

    [[alias.version]]
    name = "v2"
    model = "words"
    weight = 5
    fault_error_rate = 0.3      # ``words`` only: fail this share of its streams
    fault_latency_ms = 0        # ``words`` only: extra delay before the first token
    interval_ms = 0             # ``words`` only: the pace of its words for a request that
                                # sets none (the compatible APIs cannot)

An alias has one ``stable`` version and at most one other (the canary); weights are
percentages that add up to 100. An ``auto`` alias needs both. Every value is checked when
the file is read, and a :class:`~sluice.errors.ConfigError` names the file, the alias,
the version and the key that is wrong.
"""

from __future__ import annotations

import enum
import itertools
import math
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from sluice.errors import ConfigError

__all__ = [
    "DEFAULT_STEPS",
    "MAX_FAULT_LATENCY_MS",
    "MAX_INTERVAL_MS",
    "MAX_VERSIONS",
    "AliasConfig",
    "AnalysisSettings",
    "ModelsConfig",
    "RolloutMode",
    "VersionConfig",
    "load_models_config",
    "parse_models_config",
]

# One stable version and one canary: promotion and rollback move weight between two.
MAX_VERSIONS: Final = 2
DEFAULT_STEPS: Final = (5.0, 25.0, 50.0, 100.0)
# A fault delay past a minute is a hang, not a latency regression to demonstrate.
MAX_FAULT_LATENCY_MS: Final = 60_000.0
# A words version's pace: slow enough for any demo, bounded like every other wait.
MAX_INTERVAL_MS: Final = 10_000.0
# Weights that add up to 100 within this (floating-point sums of decimals).
_WEIGHT_TOLERANCE = 1e-6
_ALIAS_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")
_VERSION_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_WORDS = "words"


class RolloutMode(enum.StrEnum):
    """``auto``: the analysis promotes and rolls back; ``manual``: weights change by hand."""

    AUTO = "auto"
    MANUAL = "manual"


@dataclass(frozen=True, slots=True)
class AnalysisSettings:
    """How the canary is judged (see :mod:`sluice.rollout.analysis`)."""

    # The chance that a canary as good as the stable version is ever rolled back, over
    # its whole rollout (the sequential test's bound holds however long it runs).
    false_alarm_rate: float = 0.01
    # The ratio of bad-stream rates (canary over stable) the test is sized to detect.
    effect: float = 2.0
    # Canary streams at a step before it may be promoted to the next.
    step_streams: int = 200
    steps: tuple[float, ...] = DEFAULT_STEPS

    def __post_init__(self) -> None:
        if not 0 < self.false_alarm_rate < 0.5:
            raise ConfigError(f"false_alarm_rate must be in (0, 0.5), got {self.false_alarm_rate}")
        if not 1 < self.effect <= 100:
            raise ConfigError(f"effect must be in (1, 100], got {self.effect}")
        if not 1 <= self.step_streams <= 1_000_000:
            raise ConfigError(f"step_streams must be in [1, 1000000], got {self.step_streams}")
        steps = self.steps
        if not steps or any(not 0 < step <= 100 for step in steps):
            raise ConfigError(f"steps must be weights in (0, 100], got {list(steps)}")
        if any(b <= a for a, b in itertools.pairwise(steps)) or steps[-1] != 100:
            raise ConfigError(f"steps must increase and end at 100, got {list(steps)}")


@dataclass(frozen=True, slots=True)
class VersionConfig:
    """One version of an alias: the served model behind it and its share of streams."""

    name: str
    model: str
    weight: float
    stable: bool = False
    fault_error_rate: float = 0.0
    fault_latency_ms: float = 0.0
    interval_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class AliasConfig:
    """A public model name and its versions (the stable one first)."""

    name: str
    mode: RolloutMode
    versions: tuple[VersionConfig, ...]
    analysis: AnalysisSettings = field(default_factory=AnalysisSettings)

    @property
    def stable(self) -> VersionConfig:
        return self.versions[0]

    @property
    def canary(self) -> VersionConfig | None:
        return self.versions[1] if len(self.versions) > 1 else None


@dataclass(frozen=True, slots=True)
class ModelsConfig:
    """Every alias of the file, in its order."""

    aliases: tuple[AliasConfig, ...] = ()

    def alias(self, name: str) -> AliasConfig | None:
        for alias in self.aliases:
            if alias.name == name:
                return alias
        return None


_ALIAS_KEYS = frozenset(
    {"name", "rollout", "steps", "step_streams", "false_alarm_rate", "effect", "version"}
)
_VERSION_KEYS = frozenset(
    {"name", "model", "weight", "stable", "fault_error_rate", "fault_latency_ms", "interval_ms"}
)


def load_models_config(path: Path) -> ModelsConfig:
    """Read and check the models config at ``path``."""
    try:
        with path.open("rb") as file:
            document = tomllib.load(file)
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not TOML: {exc}") from exc
    return parse_models_config(document, source=str(path))


def parse_models_config(document: Mapping[str, object], *, source: str = "models") -> ModelsConfig:
    """Check a parsed TOML document; errors start with ``source``."""
    _refuse_unknown(document, frozenset({"alias"}), source)
    tables = document.get("alias", [])
    if not isinstance(tables, list) or not tables:
        raise ConfigError(f"{source}: 'alias' must be a non-empty array of tables ([[alias]])")
    aliases: list[AliasConfig] = []
    for number, table in enumerate(tables, start=1):
        alias = _alias(table, f"{source}: alias {number}")
        if any(seen.name == alias.name for seen in aliases):
            raise ConfigError(f"{source}: alias {alias.name!r} is defined twice")
        aliases.append(alias)
    return ModelsConfig(tuple(aliases))


def _alias(table: object, where: str) -> AliasConfig:
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: not a table")
    name = table.get("name")
    if not isinstance(name, str) or not _ALIAS_NAME.fullmatch(name):
        raise ConfigError(
            f"{where}: 'name' must be 1-128 characters of letters, digits and '._:/-'"
        )
    where = f"{where} ({name!r})"
    _refuse_unknown(table, _ALIAS_KEYS, where)
    mode_text = table.get("rollout", RolloutMode.AUTO.value)
    if mode_text not in {mode.value for mode in RolloutMode}:
        raise ConfigError(f"{where}: 'rollout' must be 'auto' or 'manual', got {mode_text!r}")
    mode = RolloutMode(mode_text)
    analysis = _analysis(table, where)
    tables = table.get("version")
    if not isinstance(tables, list) or not tables:
        raise ConfigError(f"{where}: 'version' must be a non-empty array of tables")
    if len(tables) > MAX_VERSIONS:
        raise ConfigError(
            f"{where}: {len(tables)} versions; at most {MAX_VERSIONS} (one stable, one canary)"
        )
    versions = [_version(item, f"{where}: version {n}") for n, item in enumerate(tables, 1)]
    names = [version.name for version in versions]
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}: version names must differ, got {names}")
    stable = [version for version in versions if version.stable]
    if len(stable) != 1:
        raise ConfigError(f"{where}: exactly one version must have 'stable = true'")
    total = math.fsum(version.weight for version in versions)
    if abs(total - 100) > _WEIGHT_TOLERANCE:
        raise ConfigError(f"{where}: the versions' weights add up to {total:g}, not 100")
    if mode is RolloutMode.AUTO and len(versions) != MAX_VERSIONS:
        raise ConfigError(f"{where}: 'rollout = \"auto\"' needs a stable version and a canary")
    ordered = (*stable, *(version for version in versions if not version.stable))
    return AliasConfig(name, mode, ordered, analysis)


def _analysis(table: Mapping[str, object], where: str) -> AnalysisSettings:
    defaults = AnalysisSettings()
    steps = table.get("steps", list(defaults.steps))
    if not isinstance(steps, list) or not all(_is_number(step) for step in steps):
        raise ConfigError(f"{where}: 'steps' must be an array of numbers")
    step_streams = table.get("step_streams", defaults.step_streams)
    if not isinstance(step_streams, int) or isinstance(step_streams, bool):
        raise ConfigError(f"{where}: 'step_streams' must be an integer")
    rate = _number(table, "false_alarm_rate", defaults.false_alarm_rate, where)
    effect = _number(table, "effect", defaults.effect, where)
    try:
        return AnalysisSettings(
            false_alarm_rate=rate,
            effect=effect,
            step_streams=step_streams,
            steps=tuple(float(step) for step in steps),
        )
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def _version(table: object, where: str) -> VersionConfig:
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: not a table")
    name = table.get("name")
    if not isinstance(name, str) or not _VERSION_NAME.fullmatch(name):
        raise ConfigError(f"{where}: 'name' must be 1-64 characters of letters, digits and '._-'")
    where = f"{where} ({name!r})"
    _refuse_unknown(table, _VERSION_KEYS, where)
    model = table.get("model")
    if not isinstance(model, str) or not model:
        raise ConfigError(f"{where}: 'model' (the name of a served model) is required")
    if "weight" not in table:
        raise ConfigError(f"{where}: 'weight' (percent of the alias's streams) is required")
    weight = _number(table, "weight", 0.0, where)
    if not 0 <= weight <= 100:
        raise ConfigError(f"{where}: 'weight' must be in [0, 100], got {weight:g}")
    stable = table.get("stable", False)
    if not isinstance(stable, bool):
        raise ConfigError(f"{where}: 'stable' must be true or false")
    error_rate = _number(table, "fault_error_rate", 0.0, where)
    latency_ms = _number(table, "fault_latency_ms", 0.0, where)
    interval_ms = _number(table, "interval_ms", 0.0, where)
    if (error_rate or latency_ms or interval_ms) and model != _WORDS:
        raise ConfigError(
            f"{where}: 'fault_error_rate', 'fault_latency_ms' and 'interval_ms' are for 'words'"
        )
    if not 0 <= interval_ms <= MAX_INTERVAL_MS:
        raise ConfigError(
            f"{where}: 'interval_ms' must be in [0, {MAX_INTERVAL_MS:g}], got {interval_ms:g}"
        )
    if not 0 <= error_rate <= 1:
        raise ConfigError(f"{where}: 'fault_error_rate' must be in [0, 1], got {error_rate:g}")
    if not 0 <= latency_ms <= MAX_FAULT_LATENCY_MS:
        raise ConfigError(
            f"{where}: 'fault_latency_ms' must be in [0, {MAX_FAULT_LATENCY_MS:g}], "
            f"got {latency_ms:g}"
        )
    return VersionConfig(name, model, weight, stable, error_rate, latency_ms, interval_ms)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _number(table: Mapping[str, object], key: str, default: float, where: str) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{where}: {key!r} must be a number, got {value!r}")
    return float(value)


def _refuse_unknown(table: Mapping[str, object], known: frozenset[str], where: str) -> None:
    unknown = set(table) - known
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(sorted(unknown))}; "
            f"known: {', '.join(sorted(known))}"
        )
