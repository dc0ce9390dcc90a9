"""The models config: the documented shape parses; every mistake names its key."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from sluice.errors import ConfigError
from sluice.rollout.config import (
    DEFAULT_STEPS,
    ModelsConfig,
    RolloutMode,
    load_models_config,
    parse_models_config,
)

EXAMPLE = """
[[alias]]
name = "assistant"
rollout = "auto"

[[alias.version]]
name = "v1"
model = "words"
weight = 95
stable = true

[[alias.version]]
name = "v2"
model = "words"
weight = 5
fault_error_rate = 0.3
fault_latency_ms = 0
"""


def parse(text: str) -> ModelsConfig:
    return parse_models_config(tomllib.loads(text), source="models.toml")


def test_issue_example_parses_with_stable_first_and_default_analysis(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text(EXAMPLE)
    config = load_models_config(path)
    (alias,) = config.aliases
    assert alias.name == "assistant"
    assert alias.mode is RolloutMode.AUTO
    assert alias.stable.name == "v1"
    assert alias.stable.weight == 95
    assert alias.canary is not None
    assert alias.canary.fault_error_rate == 0.3
    assert alias.analysis.steps == DEFAULT_STEPS
    assert config.alias("assistant") is alias
    assert config.alias("other") is None


def test_stable_listed_second_is_still_the_stable_version() -> None:
    text = EXAMPLE.replace("stable = true\n", "").replace(
        "weight = 5\n", "weight = 5\nstable = true\n"
    )
    (alias,) = parse(text).aliases
    assert alias.stable.name == "v2"
    assert alias.canary is not None
    assert alias.canary.name == "v1"


def test_analysis_options_are_read() -> None:
    text = EXAMPLE.replace(
        'rollout = "auto"',
        'rollout = "auto"\nsteps = [10, 100]\nstep_streams = 50\nfalse_alarm_rate = 0.05\n'
        "effect = 3",
    )
    analysis = parse(text).aliases[0].analysis
    assert analysis.steps == (10.0, 100.0)
    assert analysis.step_streams == 50
    assert analysis.false_alarm_rate == 0.05
    assert analysis.effect == 3.0


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            ("weight = 5\n", 'weight = 5\ncolour = "red"\n'),
            r"version 2 \('v2'\): unknown key\(s\) colour",
        ),
        (
            ('rollout = "auto"', 'rollout = "auto"\nspeed = 1'),
            r"alias 1 \('assistant'\): unknown key\(s\) speed",
        ),
        (('rollout = "auto"', 'rollout = "sometimes"'), "'rollout' must be 'auto' or 'manual'"),
        (("weight = 5\n", "weight = 6\n"), "weights add up to 101, not 100"),
        (("weight = 5\n", 'weight = "5"\n'), "'weight' must be a number"),
        (("weight = 95\n", "weight = 195\n"), r"'weight' must be in \[0, 100\]"),
        (("stable = true\n", ""), "exactly one version must have 'stable = true'"),
        (("stable = true\n", 'stable = "yes"\n'), "'stable' must be true or false"),
        (('name = "v2"', 'name = "v1"'), "version names must differ"),
        (('name = "v2"', 'name = "bad name"'), "version 2: 'name' must be"),
        (
            ("fault_error_rate = 0.3", "fault_error_rate = 1.5"),
            r"'fault_error_rate' must be in \[0, 1\]",
        ),
        (("fault_latency_ms = 0", "fault_latency_ms = -1"), "'fault_latency_ms' must be in"),
        (("fault_latency_ms = 0", "interval_ms = 20000"), r"'interval_ms' must be in \[0, 10000\]"),
    ],
)
def test_mistakes_name_the_alias_version_and_key(edit: tuple[str, str], message: str) -> None:
    text = EXAMPLE.replace(*edit)
    assert text != EXAMPLE
    with pytest.raises(ConfigError, match=message) as caught:
        parse(text)
    assert str(caught.value).startswith("models.toml: ")


def test_fault_options_are_for_words_only() -> None:
    text = EXAMPLE.replace('name = "v2"\nmodel = "words"', 'name = "v2"\nmodel = "sluice-tiny"')
    with pytest.raises(
        ConfigError,
        match="'fault_error_rate', 'fault_latency_ms' and 'interval_ms' are for 'words'",
    ):
        parse(text)


def test_auto_needs_a_canary_but_manual_may_have_one_version() -> None:
    one = '[[alias]]\nname = "a"\n{mode}\n[[alias.version]]\nname = "v1"\nmodel = "words"\nweight = 100\nstable = true\n'
    with pytest.raises(ConfigError, match="needs a stable version and a canary"):
        parse(one.format(mode=""))
    (alias,) = parse(one.format(mode='rollout = "manual"')).aliases
    assert alias.canary is None


def test_three_versions_are_refused() -> None:
    extra = '\n[[alias.version]]\nname = "v3"\nmodel = "words"\nweight = 0\n'
    with pytest.raises(ConfigError, match="3 versions; at most 2"):
        parse(EXAMPLE + extra)


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        ("[5, 25]", "end at 100"),
        ("[25, 5, 100]", "increase"),
        ("[0, 100]", r"in \(0, 100\]"),
        ('["a"]', "array of numbers"),
    ],
)
def test_bad_steps_are_refused(steps: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse(EXAMPLE.replace('rollout = "auto"', f'rollout = "auto"\nsteps = {steps}'))


def test_duplicate_alias_and_unknown_top_level_key_are_refused() -> None:
    with pytest.raises(ConfigError, match="alias 'assistant' is defined twice"):
        parse(EXAMPLE + EXAMPLE)
    with pytest.raises(ConfigError, match=r"unknown key\(s\) models"):
        parse("models = 1\n" + EXAMPLE)
    with pytest.raises(ConfigError, match="non-empty array of tables"):
        parse("")


def test_unreadable_and_malformed_files_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"missing\.toml"):
        load_models_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[[alias]\n")
    with pytest.raises(ConfigError, match=r"bad\.toml: not TOML"):
        load_models_config(bad)
