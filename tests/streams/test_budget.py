"""The log budget's accounting and eviction order, as pure logic (no hub, no log)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from sluice.streams.budget import LogBudget
from sluice.streams.sizing import LOG_BYTES

MiB = 1024 * 1024


def budget(
    budget_bytes: int = 100 * MiB,
    per_tenant: int = 100 * MiB,
    retained_per_tenant: int = 1000,
) -> LogBudget:
    return LogBudget(
        budget_bytes=budget_bytes,
        max_bytes_per_tenant=per_tenant,
        max_retained_per_tenant=retained_per_tenant,
    )


def finished(ledger: LogBudget, stream_id: str, tenant: str, num_bytes: int) -> None:
    ledger.opened(stream_id, tenant, LOG_BYTES)
    ledger.resized(stream_id, num_bytes)
    assert ledger.retain(stream_id) == []


def test_over_the_budget_the_tenants_own_oldest_retained_stream_goes_first() -> None:
    ledger = budget(budget_bytes=100 * MiB)
    finished(ledger, "a1", "a", 20 * MiB)
    finished(ledger, "b1", "b", 20 * MiB)
    finished(ledger, "a2", "a", 20 * MiB)
    finished(ledger, "b2", "b", 20 * MiB)
    ledger.opened("live-b", "b", LOG_BYTES)
    assert ledger.resized("live-b", 30 * MiB)  # 110 MiB in all
    assert ledger.victim("b") == ("b1", "log_memory")
    ledger.forget("b1", evicted_for="log_memory")
    assert ledger.victim("b") is None  # 90 MiB: under the budget again
    assert ledger.resized("live-b", 70 * MiB)  # 130 MiB: b has b2 left, then a's go
    assert ledger.victim("b") == ("b2", "log_memory")
    ledger.forget("b2", evicted_for="log_memory")
    assert ledger.victim("b") == ("a1", "log_memory")
    assert ledger.evictions == {"log_memory": 2}


def test_a_tenant_over_its_bytes_evicts_only_its_own_retained_streams() -> None:
    ledger = budget(budget_bytes=1000 * MiB, per_tenant=50 * MiB)
    finished(ledger, "b1", "b", 10 * MiB)
    finished(ledger, "a1", "a", 30 * MiB)
    ledger.opened("live-a", "a", LOG_BYTES)
    assert ledger.resized("live-a", 30 * MiB)
    assert ledger.victim("a") == ("a1", "tenant_log_bytes")
    ledger.forget("a1", evicted_for="tenant_log_bytes")
    assert ledger.resized("live-a", 60 * MiB)
    assert ledger.victim("a") is None  # b's stream is not a's to take
    assert ledger.trim_target("live-a") is not None


def test_a_creation_is_refused_only_when_live_streams_alone_fill_a_bound() -> None:
    """Full means nine tenths held by live streams: retained ones would be evicted."""
    ledger = budget(budget_bytes=100 * MiB, per_tenant=60 * MiB)
    ledger.opened("live-a", "a", LOG_BYTES)
    ledger.resized("live-a", 50 * MiB)
    finished(ledger, "a1", "a", 9 * MiB)
    finished(ledger, "b1", "b", 40 * MiB)
    assert ledger.refusal("b") is None  # b's 40 MiB are evictable
    assert ledger.refusal("a") is None  # so are a's 9 (a's live 50 MiB are under 54)
    ledger.resized("live-a", 55 * MiB)
    assert ledger.refusal("a") == "tenant_log_bytes"  # a's live streams fill its share
    assert ledger.refusal("b") is None
    ledger.opened("live-b", "b", LOG_BYTES)
    ledger.resized("live-b", 36 * MiB)
    assert ledger.refusal("c") == "log_memory"  # 91 MiB of live streams fill the server


def test_a_tenant_past_its_retained_count_loses_its_oldest() -> None:
    ledger = budget(retained_per_tenant=2)
    finished(ledger, "a1", "a", MiB)
    finished(ledger, "b1", "b", MiB)
    finished(ledger, "a2", "a", MiB)
    ledger.opened("a3", "a", LOG_BYTES)
    assert ledger.retain("a3") == [("a1", "tenant_retained_streams")]
    assert ledger.retained_of("b") == 1


def test_a_full_server_evicts_the_creators_own_oldest_then_the_oldest_of_all() -> None:
    ledger = budget()
    finished(ledger, "a1", "a", MiB)
    finished(ledger, "b1", "b", MiB)
    finished(ledger, "b2", "b", MiB)
    assert ledger.oldest("b") == "b1"
    assert ledger.oldest("c") == "a1"
    assert budget().oldest("c") is None


def test_a_growing_stream_over_the_budget_gives_up_what_it_is_over_and_a_tenth() -> None:
    ledger = budget(budget_bytes=100 * MiB)
    ledger.opened("big", "a", LOG_BYTES)
    ledger.opened("small", "b", LOG_BYTES)
    ledger.resized("small", 20 * MiB)
    assert ledger.trim_target("big") is None
    ledger.resized("big", 82 * MiB)  # 102 MiB: over by 2, and over its share of 50
    target = ledger.trim_target("big")
    assert target is not None
    assert target <= 50 * MiB
    assert target >= 40 * MiB  # a tenth less than its share, not more
    ledger.resized("big", 50 * MiB)
    ledger.resized("small", 52 * MiB)  # 102 MiB: small is over by 2, and over its share
    small_target = ledger.trim_target("small")
    assert small_target is not None
    assert small_target <= 50 * MiB


def test_forgetting_every_stream_leaves_nothing_behind() -> None:
    ledger = budget()
    finished(ledger, "a1", "a", MiB)
    ledger.opened("a2", "a", LOG_BYTES)
    ledger.forget("a1")
    ledger.forget("a2")
    ledger.forget("never-seen")
    assert (len(ledger), ledger.num_bytes, ledger.num_live, ledger.retained_bytes) == (0, 0, 0, 0)
    assert ledger.bytes_of("a") == 0
    assert ledger.evictions == {}


_OPS = st.lists(
    st.tuples(
        st.sampled_from(["open", "grow", "retain", "forget", "evict"]),
        st.integers(0, 7),  # stream
        st.integers(0, 2),  # tenant
        st.integers(0, 40 * MiB),
    ),
    max_size=60,
)


@given(_OPS)
def test_counts_and_bytes_always_add_up(ops: list[tuple[str, int, int, int]]) -> None:
    """Whatever happens, the totals are the sums of the streams, per tenant and in all, and
    what the budget offers to evict is a retained stream."""
    ledger = budget(budget_bytes=100 * MiB, per_tenant=50 * MiB, retained_per_tenant=2)
    streams: dict[str, tuple[str, int, bool]] = {}  # id -> tenant, bytes, retained
    for op, number, tenant_number, size in ops:
        stream_id, tenant = f"s{number}", f"t{tenant_number}"
        if op == "open" and stream_id not in streams:
            ledger.opened(stream_id, tenant, size)
            streams[stream_id] = (tenant, size, False)
        elif op == "grow" and stream_id in streams and not streams[stream_id][2]:
            owner = streams[stream_id][0]
            ledger.resized(stream_id, size)
            streams[stream_id] = (owner, size, False)
        elif op == "retain" and stream_id in streams:
            owner, held, _ = streams[stream_id]
            victims = ledger.retain(stream_id)
            streams[stream_id] = (owner, held, True)
            for victim, reason in victims:
                assert reason == "tenant_retained_streams"
                assert streams[victim][0] == owner
                assert streams[victim][2]
                ledger.forget(victim, evicted_for=reason)
                del streams[victim]
        elif op == "forget" and stream_id in streams:
            ledger.forget(stream_id)
            del streams[stream_id]
        elif op == "evict":
            offered = ledger.victim(tenant, size)
            if offered is not None:
                assert streams[offered[0]][2]  # only retained streams are evicted
                ledger.forget(offered[0], evicted_for=offered[1])
                del streams[offered[0]]
        assert ledger.num_bytes == sum(held for _, held, _ in streams.values())
        assert ledger.retained_bytes == sum(held for _, held, kept in streams.values() if kept)
        assert ledger.num_live == sum(not kept for _, _, kept in streams.values())
        assert len(ledger) == len(streams)
        for owner in ("t0", "t1", "t2"):
            mine = [(held, kept) for t, held, kept in streams.values() if t == owner]
            assert ledger.bytes_of(owner) == sum(held for held, _ in mine)
            assert ledger.retained_of(owner) == sum(kept for _, kept in mine) <= 2


def test_with_one_tenant_a_full_server_is_the_servers_refusal_not_the_tenants() -> None:
    ledger = budget(budget_bytes=100 * MiB, per_tenant=100 * MiB)
    ledger.opened("live", "anonymous", LOG_BYTES)
    ledger.resized("live", 95 * MiB)
    assert ledger.refusal("anonymous") == "log_memory"  # a 503, not a 429
