"""Sticky assignment: stable buckets, weights honoured, only crossing buckets move."""

from __future__ import annotations

import random

from scipy import stats

from sluice.rollout.assignment import NUM_BUCKETS, bucket_of, in_canary

KEYS = [f"user-{n}" for n in range(20_000)]


def test_bucket_is_the_same_for_the_same_key_and_differs_by_alias() -> None:
    assert bucket_of("assistant", "alice") == bucket_of("assistant", "alice")
    assert 0 <= bucket_of("assistant", "alice") < NUM_BUCKETS
    moved = sum(bucket_of("a", key) != bucket_of("b", key) for key in KEYS[:1000])
    assert moved > 990  # another alias shuffles the keys independently


def test_known_bucket_does_not_change_between_releases() -> None:
    """Pinned: a change of hash would move every user at the next deploy."""
    assert [bucket_of("assistant", key) for key in ("alice", "bob", "")] == [6191, 3609, 9960]


def test_share_of_keys_in_canary_is_within_a_binomial_bound() -> None:
    rng = random.Random(0)
    num = sum(in_canary("assistant", key, 5, rng) for key in KEYS)
    low, high = stats.binom.interval(0.999, len(KEYS), 0.05)
    assert low <= num <= high


def test_raising_the_weight_moves_only_keys_to_the_canary() -> None:
    rng = random.Random(0)
    before = {key for key in KEYS if in_canary("assistant", key, 5, rng)}
    after = {key for key in KEYS if in_canary("assistant", key, 25, rng)}
    assert before <= after  # nobody left the canary
    moved = after - before
    assert all(500 <= bucket_of("assistant", key) < 2500 for key in moved)


def test_zero_and_full_weights_are_absolute() -> None:
    rng = random.Random(0)
    assert not any(in_canary("assistant", key, 0, rng) for key in KEYS[:500])
    assert all(in_canary("assistant", key, 100, rng) for key in KEYS[:500])


def test_keyless_streams_are_drawn_at_the_weight() -> None:
    rng = random.Random(7)
    num = sum(in_canary("assistant", None, 30, rng) for _ in range(10_000))
    low, high = stats.binom.interval(0.999, 10_000, 0.3)
    assert low <= num <= high
