"""Speculation's pure parts: prompt lookup, adaptive k, the scheduler's lookahead slots and
the block manager's lookahead blocks (no torch)."""

from __future__ import annotations

import math
import random

import pytest

from sluice.engine.block_manager import BlockManager
from sluice.engine.scheduler import Scheduler, SchedulerConfig
from sluice.engine.sequence import Sequence
from sluice.engine.speculative import (
    AdaptiveK,
    SpecDecodeStats,
    SpeculativeConfig,
    _Growth,
    propose_ngram,
)


def test_ngram_proposes_what_followed_the_latest_longest_match() -> None:
    # The suffix [1, 2] last occurred at index 3 (followed by 9, 9), before at 0 (by 3).
    assert propose_ngram([1, 2, 3, 1, 2, 9, 9, 1, 2], 2) == [9, 9]
    assert propose_ngram([1, 2, 3, 1, 2, 9, 9, 1, 2], 5) == [9, 9, 1, 2]


def test_ngram_prefers_the_longer_suffix() -> None:
    # [7, 1] recurs (followed by 5); [1] alone last occurred followed by 6.
    assert propose_ngram([7, 1, 5, 1, 6, 7, 1], 1) == [5]


def test_ngram_without_a_match_proposes_nothing() -> None:
    assert propose_ngram([1, 2, 3, 4], 3) == []
    assert propose_ngram([4], 3) == []
    assert propose_ngram([1, 1, 1], 0) == []
    assert propose_ngram([5, 6, 5, 6], 2, ngram_min=3) == []


def test_config_refuses_values_that_cannot_hold() -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig("ngram", 0)
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig("medusa", 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ngram_min"):
        SpeculativeConfig("ngram", 2, ngram_min=3, ngram_max=2)


def run_policy(policy: AdaptiveK, num_decodes: int, cost_s: dict[int, float], steps: int) -> int:
    k = 0
    for _ in range(steps):
        k = policy.choose(num_decodes)
        policy.observe(num_decodes, k, cost_s[k])
    return policy.choose(num_decodes)


def test_adaptive_k_speculates_when_verify_is_cheap_and_drafts_are_accepted() -> None:
    policy = AdaptiveK(4)
    for _ in range(500):
        policy.accepted(4, 4)
    chosen = run_policy(policy, 1, {0: 1.0, 1: 1.1, 2: 1.2, 3: 1.3, 4: 1.4}, steps=40)
    assert chosen == 4


def test_adaptive_k_drafts_at_most_four_in_a_wide_batch_however_well_more_would_do() -> None:
    costs = {k: 1.0 + 0.1 * k for k in range(7)}
    narrow, wide = AdaptiveK(6), AdaptiveK(6)
    for policy in (narrow, wide):
        for _ in range(500):
            policy.accepted(6, 6)
    assert run_policy(narrow, 4, costs, steps=60) == 6
    chosen = []
    for _ in range(60):
        chosen.append(wide.choose(64))
        wide.observe(64, chosen[-1], costs[chosen[-1]])
    assert max(chosen) == 4
    assert wide.choose(64) == 4


def test_adaptive_k_turns_off_at_a_batch_where_speculation_costs_more_than_it_yields() -> None:
    policy = AdaptiveK(4)
    for _ in range(500):
        policy.accepted(2, 1)  # position 1 mostly accepted, position 2 never
    costs = {0: 1.0, 1: 2.2, 2: 2.8, 3: 3.7, 4: 4.6}
    assert run_policy(policy, 64, costs, steps=40) == 0
    assert policy.choose(64) == 0


def test_adaptive_k_climbs_past_a_k_that_loses_narrowly_to_one_that_wins() -> None:
    """A step's fixed costs (the verify's layout, the draft's catch-up) make k=1 lose to
    no speculation by 10% where k=3 wins by 20%: the climb goes on past k=1."""
    policy = AdaptiveK(3)
    for _ in range(800):
        policy.accepted(3, 3 if _ % 5 else 0)  # about 0.8 at each position
    costs = {0: 1.0, 1: 2.0, 2: 2.2, 3: 2.4}
    assert run_policy(policy, 1, costs, steps=40) == 3


def test_adaptive_k_does_not_climb_again_to_a_k_seen_clearly_behind() -> None:
    """A k with fewer samples than a measurement takes but already far behind the best is
    not tried again on every step that the one below it comes close."""
    policy = AdaptiveK(2)
    for _ in range(500):
        policy.accepted(2, 1)  # position 1 accepted, position 2 never: E(1) = E(2) = 2
    for _ in range(4):  # the first of each a warm-up
        policy.observe(4, 0, 1.0)
        policy.observe(4, 1, 2.2)  # 10% behind k=0: a narrow batch climbs on
    for _ in range(3):
        policy.observe(4, 2, 5.0)  # far behind, 2 samples of 3
    assert policy.choose(4) == 0


def test_adaptive_k_does_not_explore_a_larger_batch_past_what_pays_at_a_smaller_one() -> None:
    """Speculation that settled off at 16 streams is not tried at 64, where verify and drafts
    cost more against a plain decode; whatever the costs there would have been."""
    policy = AdaptiveK(4, explore_every=8)
    for _ in range(500):
        policy.accepted(4, 1)  # position 1 accepted, position 2 never: E(k >= 1) = 2
    assert run_policy(policy, 16, {0: 1.0, 1: 2.2, 2: 2.8, 3: 3.7, 4: 4.6}, steps=40) == 0
    chosen = set()
    for _ in range(100):
        chosen.add(policy.choose(64))
        policy.observe(64, 0, 1.0)
    assert chosen == {0}


def test_adaptive_k_climbs_a_larger_batch_at_most_to_the_smaller_ones_best() -> None:
    policy = AdaptiveK(6, explore_every=8)
    for _ in range(500):
        policy.accepted(6, 6)
    assert run_policy(policy, 4, {0: 1.0, 1: 1.1, 2: 1.2, 3: 3.3, 4: 4.4, 5: 5.5, 6: 6.6}, 40) == 2
    cheap = {k: 1.0 + 0.05 * k for k in range(7)}  # at 16, more would pay; 2 is the ceiling
    chosen = []
    for _ in range(100):
        chosen.append(policy.choose(16))
        policy.observe(16, chosen[-1], cheap[chosen[-1]])
    assert max(chosen) == 2
    assert policy.choose(16) == 2


def test_adaptive_k_takes_no_ceiling_from_a_batch_size_seen_for_a_few_steps() -> None:
    """A smaller bucket that settled off in fewer than ``explore_every`` steps (a few steps
    between larger batches: noise) does not keep a larger one from speculating."""
    policy = AdaptiveK(2, explore_every=64)
    for _ in range(500):
        policy.accepted(2, 2)
    assert run_policy(policy, 16, {0: 1.0, 1: 5.0, 2: 9.0}, steps=10) == 0
    assert run_policy(policy, 64, {0: 1.0, 1: 1.1, 2: 1.2}, steps=40) == 2


def test_adaptive_k_takes_no_cost_from_the_first_step_at_a_k() -> None:
    """The first step of a batch size and k runs new shapes, and pays one-off costs (twice
    a step, measured on the bundled pair): it does not make that k look clearly behind, and
    the climb goes on."""
    policy = AdaptiveK(2)
    for _ in range(500):
        policy.accepted(2, 2)  # E(1) = 2, E(2) = 3
    for _ in range(4):
        policy.observe(4, 0, 1.0)
    assert policy.choose(4) == 1
    policy.observe(4, 1, 4.0)  # cold: alone, four times k=0 for twice its tokens
    assert policy.choose(4) == 1
    for _ in range(3):
        policy.observe(4, 1, 1.2)
    assert policy.choose(4) == 2


def test_adaptive_k_does_not_climb_past_a_losing_k_in_a_wide_batch() -> None:
    """In a batch of more than four decodes each drafted token costs about as much as the
    last: a k that loses to the one below it is not followed by a larger one."""
    policy = AdaptiveK(2)
    for _ in range(500):
        policy.accepted(2, 2)  # E(1) = 2, E(2) = 3
    for _ in range(4):
        policy.observe(16, 0, 1.0)
        policy.observe(16, 1, 2.1)  # 5% behind k=0
    assert [policy.choose(16) for _ in range(3)] == [0, 0, 0]


def test_adaptive_k_looks_at_a_neighbour_for_a_measurement_not_one_step() -> None:
    """A look at a neighbour of the best k takes three steady steps, like its first
    measurement: a single slow step (the machine busy) does not settle it."""
    policy = AdaptiveK(1, explore_every=8)
    for _ in range(500):
        policy.accepted(1, 1 if _ % 4 else 0)  # E(1) = 1.75
    assert run_policy(policy, 4, {0: 1.0, 1: 2.0}, steps=40) == 0
    chosen = [policy.choose(4)]
    while chosen[-1] == 0:
        policy.observe(4, 0, 1.0)
        chosen.append(policy.choose(4))
    for seconds in (3.0, 1.5, 1.5):  # the look: now k=1 pays, but its first step was slow
        policy.observe(4, 1, seconds)
        chosen.append(policy.choose(4))
    assert chosen[-4:] == [1, 1, 1, 1]


def test_adaptive_k_switches_on_in_a_wide_batch_only_when_speculation_clearly_pays() -> None:
    """Beyond four decodes a k must score 15% better than none: what the score leaves out
    (sequences finishing steps apart, the draft's catch-up on new prompts) cost more than
    10% at 16 streams."""
    for num_decodes, chosen in ((4, 1), (16, 0)):
        policy = AdaptiveK(1)
        for _ in range(500):
            policy.accepted(1, 1)  # E(1) = 2
        assert run_policy(policy, num_decodes, {0: 1.0, 1: 1.8}, steps=40) == chosen  # +11%


def test_adaptive_k_takes_no_k_measured_long_ago_as_the_best() -> None:
    """Steps grow dearer as contexts grow: a k last measured long ago, on shorter contexts,
    looks cheaper than the k running now, and is looked at again before it can be the best
    (here k=0: 1.0 then, and 2.0 for k=1 now, for 1.75 times the tokens)."""
    policy = AdaptiveK(1, explore_every=8)
    for _ in range(500):
        policy.accepted(1, 1 if _ % 4 else 0)  # E(1) = 1.75
    # k=0 is far behind: looked at once, then next 128 steps on.
    assert run_policy(policy, 4, {0: 1.0, 1: 1.2}, steps=40) == 1
    chosen = []
    for _ in range(60):
        chosen.append(policy.choose(4))
        policy.observe(4, chosen[-1], {0: 1.0, 1: 2.0}[chosen[-1]])  # contexts grew
    assert chosen == [1] * 60


def test_adaptive_k_climbs_a_wide_batch_past_k1_only_while_speculation_clearly_pays() -> None:
    """Beyond four decodes each drafted token costs about what the last did: a k = 1 that is
    not 15% better than none is not climbed past (here k = 2 would be, on made-up costs)."""
    policy = AdaptiveK(2)
    for _ in range(500):
        policy.accepted(2, 2)  # E(1) = 2, E(2) = 3
    for k, seconds in ((0, 1.0), (1, 1.8)):  # k=1 measured: 11% better than none
        for _ in range(4):
            policy.observe(16, k, seconds)
    assert [policy.choose(16) for _ in range(3)] == [0, 0, 0]


def test_adaptive_k_stops_measuring_k1_in_a_wide_batch_that_it_does_not_clearly_pay() -> None:
    policy = AdaptiveK(1)
    for _ in range(500):
        policy.accepted(1, 1)  # E(1) = 2
    for _ in range(4):
        policy.observe(16, 0, 1.0)
    chosen = []
    for _ in range(3):  # a warm-up, then one sample of k=1: 11% better than none
        chosen.append(policy.choose(16))
        policy.observe(16, chosen[-1], 1.8 if chosen[-1] else 1.0)
    assert chosen == [1, 1, 0]


def test_adaptive_k_carries_costs_to_the_context_of_now() -> None:
    """Steps grow dearer as contexts grow (1% a token here, learnt from the steps): a k
    measured on shorter contexts is compared as it would cost now."""
    policy = AdaptiveK(1)
    for _ in range(500):
        policy.accepted(1, 1 if _ % 4 else 0)  # E(1) = 1.75

    def cost(k: int, context: int) -> float:
        return (1.5 if k else 1.0) * math.exp(0.01 * (context - 40))

    for k in (0, 1):
        for _ in range(4):
            policy.observe(4, k, cost(k, 40), context=40)
    chosen = []
    for context in range(41, 100):
        chosen.append(policy.choose(4, context=context))
        policy.observe(4, chosen[-1], cost(chosen[-1], context), context=context)
    # k=0's 1.0, carried from 40 tokens, stays behind k=1's dearer steps of now.
    assert chosen == [1] * 59


def test_adaptive_k_replaces_its_prior_acceptance_within_a_few_verifies() -> None:
    """The prior (0.6 a position) counts as one verify until the running rate takes over:
    five rejections in, a draft nobody accepts no longer looks worth a step."""
    policy = AdaptiveK(2)
    assert policy.expected_tokens(1) == pytest.approx(1.6)
    for _ in range(5):
        policy.accepted(2, 0)
    assert policy.expected_tokens(1) == pytest.approx(1.1)  # 0.6 among six
    for _ in range(500):
        policy.accepted(2, 2)
    assert policy.expected_tokens(2) > 2.99


def test_adaptive_k_gives_up_on_a_k_it_cannot_measure_until_the_next_look() -> None:
    """A k whose steps draft too little to be samples (prompt lookup finding no matches) is
    not chosen on and on unmeasured: after 12 such steps the bucket goes back to the best it
    measured, and tries again at its next look."""
    policy = AdaptiveK(1, explore_every=16)
    for _ in range(500):
        policy.accepted(1, 1)  # E(1) = 2
    for _ in range(4):
        policy.observe(1, 0, 1.0)
    chosen = []
    for _ in range(40):
        chosen.append(policy.choose(1))
        policy.observe(1, chosen[-1], 1.0, steady=chosen[-1] == 0)
    assert chosen[:13] == [1] * 12 + [0]
    assert 1 in chosen[13:]


def test_adaptive_k_turns_off_when_acceptance_is_low() -> None:
    policy = AdaptiveK(3)
    for _ in range(800):
        policy.accepted(3, 0)
    assert run_policy(policy, 1, {0: 1.0, 1: 1.2, 2: 1.4, 3: 1.6}, steps=40) == 0


def test_adaptive_k_costs_are_the_fastest_recent_steady_steps() -> None:
    """A load spike (a slow k=0 step) or a one-off catch-up (a slow k=1 step, not steady)
    does not make speculation look better or worse than it is."""
    policy = AdaptiveK(1)
    for _ in range(500):
        policy.accepted(1, 0)  # never accepted: k=1 cannot pay
    policy.observe(1, 0, 5.0)  # the first step: torch's first calls, no sample
    policy.observe(1, 0, 1.0)
    policy.observe(1, 0, 9.0)  # the machine was busy
    policy.observe(1, 0, 1.0)
    assert policy.choose(1) == 1  # k=1 not measured yet: tried
    policy.observe(1, 1, 30.0, steady=False)  # its draft caught up: no sample
    assert policy.choose(1) == 1
    for _ in range(4):  # the first a warm-up
        policy.observe(1, 1, 1.05)
    assert policy.choose(1) == 0


def test_adaptive_k_forgets_costs_measured_on_shorter_contexts() -> None:
    """Steps grow dearer as contexts grow: k=1's cheap early steps, long ago, do not make it
    look cheaper than its recent steps next to k=0's recent ones."""
    policy = AdaptiveK(1, explore_every=16)
    for _ in range(500):
        policy.accepted(1, 1 if _ % 4 else 0)  # three in four accepted: E(1) = 1.75
    for _ in range(4):  # the first a warm-up
        policy.observe(64, 0, 1.0)
    for _ in range(4):
        policy.observe(64, 1, 1.2)  # early, short contexts: k=1 pays
    assert policy.choose(64) == 1
    for _ in range(40):
        policy.observe(64, 0, 2.0)  # contexts grew
    for _ in range(2):
        policy.observe(64, 1, 4.0)  # k=1 now costs twice k=0: it does not pay
    assert [policy.choose(64) for _ in range(3)] == [0, 0, 0]  # chosen, not explored


def test_adaptive_k_switches_on_only_when_the_saving_pays_for_the_catch_up() -> None:
    """A draft model behind by many tokens (steps without drafts, new sequences) catches
    up first: a k that saves less over explore_every steps than that costs is not switched
    on; one that saves more is, and a draft that is not behind speculates as it scores."""
    policy = AdaptiveK(1, explore_every=16)
    for _ in range(500):
        policy.accepted(1, 1 if _ % 4 else 0)  # E(1) = 1.75
    for _ in range(4):  # the first a warm-up
        policy.observe(64, 0, 1.0)
    # The first k=1 step caught up on 640 tokens: 19 more than a k=0 step, 0.03 a token.
    policy.observe(64, 1, 20.0, steady=False, num_caught_up=640)
    for _ in range(4):
        policy.observe(64, 1, 1.4)  # 1.75 tokens for 1.4: saves 0.35 a step
    assert policy.choose(64) == 1  # caught up
    assert policy.choose(64, num_behind=640) == 0  # 16 x 0.35 = 5.6 does not pay 19
    assert policy.choose(64, num_behind=64) == 1  # 1.9 does
    policy.observe(64, 1, 1.4, steady=False, num_caught_up=70)  # a token or two: not a cost
    assert policy.choose(64, num_behind=64) == 1


def test_adaptive_k_takes_the_catch_up_pass_time_when_the_proposer_measured_it() -> None:
    policy = AdaptiveK(1, explore_every=16)
    for _ in range(500):
        policy.accepted(1, 1 if _ % 4 else 0)  # E(1) = 1.75
    for _ in range(4):  # the first a warm-up
        policy.observe(64, 0, 1.0)
    # The step took 40 (a load spike), its catch-up pass 6.4 for 640 tokens: 0.01 a token.
    policy.observe(64, 1, 40.0, steady=False, num_caught_up=640, catch_up_s=6.4)
    for _ in range(4):
        policy.observe(64, 1, 1.4)  # saves 0.35 a step: 5.6 over 16
    assert policy.choose(64, num_behind=640) == 0  # 6.4
    assert policy.choose(64, num_behind=200) == 1  # 2.0


def test_adaptive_k_looks_at_k1_from_no_speculation_only_when_its_catch_up_is_cheap() -> None:
    """A look at k=1 after steps without drafts costs a catch-up: it waits until the steps
    between looks make that a small share of them."""
    policy = AdaptiveK(1, explore_every=16)
    for i in range(500):
        policy.accepted(1, 1 if i % 5 < 2 else 0)  # E(1) = 1.4 for 1.5: k=0 is best
    for _ in range(4):  # the first a warm-up
        policy.observe(64, 0, 1.0)
    # A catch-up of 640 tokens cost 10 more than a k=0 step.
    policy.observe(64, 1, 11.0, steady=False, num_caught_up=640)
    for _ in range(4):
        policy.observe(64, 1, 1.5)
    looks, previous = [], 0
    for step in range(2000):
        k = policy.choose(64, num_behind=0 if previous else 640)
        if k and not previous:  # a look begins: its draft catches up
            looks.append(step)
            policy.observe(64, k, 11.0, steady=False, num_caught_up=640)
        else:
            policy.observe(64, k, 1.5 if k else 1.0)
        previous = k
    # 5% of the 16, 32, 64 and 128 steps since the last look is less than the catch-up.
    assert looks
    assert looks[0] > 200
    assert len(looks) < 10


def test_adaptive_k_buckets_batch_sizes_by_powers_of_two() -> None:
    assert [AdaptiveK.bucket(n) for n in (1, 2, 3, 4, 5, 64, 65)] == [1, 2, 4, 4, 8, 64, 128]


def test_stats_count_acceptance_per_position() -> None:
    stats = SpecDecodeStats("draft", 3)
    stats.record(3, 1)
    stats.record(2, 2)
    stats.record(0, 0)  # no draft: not counted
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 5, 3)
    assert stats.acceptance_rate_per_pos == [1.0, 0.5, 0.0]
    assert stats.num_emitted_tokens == 5
    assert stats.snapshot() == stats


def decoding(scheduler: Scheduler, seq: Sequence) -> None:
    """Run ``seq``'s prefill so it decodes next."""
    scheduler.add(seq)
    batch = scheduler.schedule()
    scheduler.postprocess(batch, {seq.seq_id: 50})


def test_scheduler_gives_lookahead_slots_and_postprocess_keeps_only_accepted_tokens() -> None:
    manager = BlockManager(8, 4)
    scheduler = Scheduler(SchedulerConfig(4, 32, 4, 4), manager)
    seq = Sequence(0, [1, 2, 3], 4)
    decoding(scheduler, seq)  # 4 tokens: one full block
    batch = scheduler.schedule({0: 5})
    (item,) = batch.items
    assert (item.num_new_tokens, item.num_lookahead_tokens) == (1, 5)
    assert batch.num_batched_tokens == 6
    assert len(seq.block_table) == 3  # positions 0..9 for the verify and its last token
    scheduler.postprocess(batch, {0: (60, 61)})  # one draft accepted, then a correction
    assert seq.token_ids == [1, 2, 3, 50, 60, 61]
    assert seq.num_computed_tokens == 5
    assert len(seq.block_table) == 2
    assert seq.num_lookahead_blocks == 0
    assert manager.num_free_blocks == 6


def test_scheduler_without_free_blocks_for_lookahead_decodes_as_usual() -> None:
    manager = BlockManager(2, 4)
    scheduler = Scheduler(SchedulerConfig(4, 32, 4, 4), manager)
    seq = Sequence(0, [1, 2, 3], 4)
    decoding(scheduler, seq)
    batch = scheduler.schedule({0: 8})
    assert batch.items[0].num_lookahead_tokens == 0
    with pytest.raises(ValueError, match="allows 1 to 1"):
        scheduler.postprocess(batch, {0: (1, 2)})
    scheduler.postprocess(batch, {0: 1})
    assert seq.num_tokens == 5


def test_lookahead_is_cut_to_the_token_budget() -> None:
    manager = BlockManager(8, 4)
    scheduler = Scheduler(SchedulerConfig(4, 3, 4, 4), manager)
    seq = Sequence(0, [1], 4)
    decoding(scheduler, seq)
    batch = scheduler.schedule({0: 6})
    assert batch.items[0].num_lookahead_tokens == 2
    scheduler.postprocess(batch, {0: (1, 2, 3)})  # all accepted, plus the bonus
    assert seq.num_tokens == 5
    assert seq.num_computed_tokens == 4
    assert len(seq.block_table) == 2  # the bonus token starts block 2


def test_a_finishing_speculative_step_frees_every_block() -> None:
    manager = BlockManager(8, 4)
    scheduler = Scheduler(SchedulerConfig(4, 32, 4, 4), manager)
    seq = Sequence(0, [1, 2], 4)
    decoding(scheduler, seq)
    batch = scheduler.schedule({0: 7})
    scheduler.postprocess(batch, {0: (4, 5, 6)}, finished_seq_ids={0})
    assert manager.num_free_blocks == 8
    assert scheduler.is_finished()


def test_abort_with_lookahead_blocks_frees_them_all() -> None:
    manager = BlockManager(8, 4)
    scheduler = Scheduler(SchedulerConfig(4, 32, 4, 4), manager)
    seq = Sequence(0, [1, 2, 3], 4)
    decoding(scheduler, seq)
    batch = scheduler.schedule({0: 6})
    scheduler.abort(0)
    scheduler.postprocess(batch, {})
    assert manager.num_free_blocks == 8
    assert manager.num_used_blocks == 0


def test_accepted_tokens_fill_and_register_lookahead_blocks_for_prefix_caching() -> None:
    manager = BlockManager(8, 4)
    seq = Sequence(0, [1, 2, 3], 4)
    manager.allocate(seq)
    manager.add_lookahead(seq, 6)  # positions up to 8: two more blocks
    assert seq.num_lookahead_blocks == 2
    assert manager.num_free_blocks == 5
    for token in (4, 5, 6, 7, 8):
        seq.append_token(token)
        manager.append_slot(seq)
    assert seq.num_lookahead_blocks == 1  # the second full block used the first lookahead
    assert (
        manager.cached_block_id(manager.blocks[seq.block_table[1]].hash or 0)
        == (seq.block_table[1])
    )
    manager.free_lookahead(seq)
    assert len(seq.block_table) == 2
    assert manager.num_free_blocks == 6


def test_the_running_growth_fit_is_the_fit_of_its_window() -> None:
    """The context growth kept as running sums equals a fresh least-squares fit of the last
    64 samples (within each k), through 3,000 samples of three k: sums added and taken away
    as the window moves, and made again now and then."""
    rng = random.Random(2)
    growth = _Growth()
    window: list[tuple[int, float, float]] = []
    for n in range(3000):
        k, context = rng.choice((0, 1, 3)), rng.uniform(20, 250)
        seconds = 0.002 * (1 + k / 4) * math.exp(0.002 * context + rng.gauss(0, 0.05))
        growth.add(k, context, seconds)
        window = [*window, (k, context, math.log(seconds))][-64:]
        if n % 97 == 0 or n == 2999:
            covariance = variance = 0.0
            for at_k in {k for k, _, _ in window}:
                points = [(x, y) for kk, x, y in window if kk == at_k]
                mean_x = sum(x for x, _ in points) / len(points)
                mean_y = sum(y for _, y in points) / len(points)
                covariance += sum((x - mean_x) * (y - mean_y) for x, y in points)
                variance += sum((x - mean_x) ** 2 for x, _ in points)
            expected = min(0.05, max(0.0, covariance / variance if variance > 0 else 0.0))
            assert growth.per_token == pytest.approx(expected, rel=1e-6, abs=1e-9)
    assert growth.per_token == pytest.approx(0.002, rel=0.5)
