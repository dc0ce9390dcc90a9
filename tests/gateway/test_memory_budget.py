"""The event logs' memory budget and tenant fairness, against real ``sluice serve`` processes.

A client looping ``POST /v1/streams`` with 100,000-token prompts (``words`` at
``interval_ms: 0``: each stream's log holds about 24 MB once it is done) must not push the
server's RSS past ``--log-memory-budget`` plus :data:`RSS_OVERHEAD_BYTES`, and must not
stop another tenant from creating streams. Finished streams are evicted oldest first; an
evicted stream answers like one whose retention ended (404).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from sluice.cli import _settings, build_parser
from sluice.gateway.settings import Settings
from tests.server import ServerProcess

MiB = 1024 * 1024
BUDGET_BYTES = 64 * MiB
# What the server may grow by beside its logs' budget, under this load: the requests and
# prompts in flight (200 kB of prompt each, as text, JSON and a decoded body), the
# allocator's free blocks between evictions. Measured: 14.5 MiB (64 MiB budget, 100
# streams), 15 MiB (256 MiB budget); twice that, for a busy machine.
RSS_OVERHEAD_BYTES = 32 * MiB
# Resumable for longer than the test, so no stream ends early for want of a reader.
BIG = {"prompt": "a " * 100_000, "interval_ms": 0, "grace_s": 600}
SMALL = {"prompt": "x", "interval_ms": 0}
KEY_A = "KEYA123456789012"
KEY_B = "KEYB123456789012"
NUM_BIG_STREAMS = 8  # about 195 MB of logs without a budget
TERMINAL = {"finished", "cancelled", "failed"}


def bearer(key: str) -> dict[str, str]:
    """The key's header (none for ``""``, an anonymous caller)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


@pytest.fixture
def keyed() -> Iterator[ServerProcess]:
    """Tenants ``a`` and ``b``; a small budget; few live streams per tenant and few streams
    in all, so finished streams would fill ``--max-streams`` without eviction."""
    options = ["--no-model", "--log-memory-budget", "64MiB"]
    options += ["--max-streams", "20", "--max-streams-per-tenant", "5"]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SLUICE_API_KEYS", f"a:{KEY_A},b:{KEY_B}")
        server = ServerProcess(*options).start()
    try:
        yield server.wait_ready()
    finally:
        server.close()


@pytest.fixture
def anonymous() -> Iterator[ServerProcess]:
    """No keys: one tenant, whose limits are the server's."""
    with pytest.MonkeyPatch.context() as env:
        env.delenv("SLUICE_API_KEYS", raising=False)
        server = ServerProcess("--no-model", "--log-memory-budget", "64MiB").start()
    try:
        yield server.wait_ready()
    finally:
        server.close()


def warm_baseline(client: httpx.Client, server: ServerProcess) -> int:
    """The server's RSS once every code path of the test has run once (lazy imports)."""
    created = client.post("/v1/streams", json=SMALL, headers=bearer(KEY_B))
    assert created.status_code == 201, created.text
    assert client.get(created.json()["events_url"]).status_code == 200
    assert client.get("/metrics").status_code == 200
    return server.rss_bytes()


def wait_until_all_ended(client: httpx.Client, ids: list[str], key: str = "") -> None:
    """Poll until every stream is over (or gone: evicted), 60 s at most."""
    deadline = time.monotonic() + 60
    for stream_id in ids:
        while True:
            response = client.get(f"/v1/streams/{stream_id}", headers=bearer(key))
            if response.status_code == 404 or response.json()["state"] in TERMINAL:
                break
            assert time.monotonic() < deadline, response.text
            time.sleep(0.05)  # polling an observable condition with a deadline


def metric(client: httpx.Client, name: str) -> float:
    total = 0.0
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.timeout(240)
def test_a_tenant_flooding_large_streams_stays_in_its_share_and_never_blocks_another(
    keyed: ServerProcess,
) -> None:
    """Tenant a fills ``--max-streams`` with finished streams, then floods large ones: its
    finished streams are evicted to make room, so tenant b gets 201 throughout, and a's
    logs stay within its share of the budget (a quarter by default, with keys)."""
    with httpx.Client(base_url=keyed.base_url, timeout=60) as client:
        baseline = warm_baseline(client, keyed)
        peak = baseline
        tiny = [client.post("/v1/streams", json=SMALL, headers=bearer(KEY_A)) for _ in range(30)]
        assert [r.status_code for r in tiny] == [201] * 30  # a evicts its own oldest
        a_ids: list[str] = []
        refused = 0
        while len(a_ids) < NUM_BIG_STREAMS:
            big = client.post("/v1/streams", json=BIG, headers=bearer(KEY_A))
            if big.status_code == 201:
                a_ids.append(big.json()["id"])
            else:  # a's own limits (live streams, their logs' bytes): wait for a's to end
                assert big.status_code == 429, big.text
                assert "retry-after" in big.headers
                refused += 1
                wait_until_all_ended(client, a_ids[-5:], KEY_A)
            small = client.post("/v1/streams", json=SMALL, headers=bearer(KEY_B))
            assert small.status_code == 201, small.text
            peak = max(peak, keyed.rss_bytes())
        wait_until_all_ended(client, a_ids, KEY_A)
        peak = max(peak, keyed.rss_bytes())
        assert refused < NUM_BIG_STREAMS
        assert metric(client, "sluice_event_log_bytes") <= BUDGET_BYTES // 4 + MiB
        assert metric(client, "sluice_streams_evicted_total") > 0
    assert peak - baseline <= BUDGET_BYTES + RSS_OVERHEAD_BYTES, (peak - baseline) / MiB


@pytest.mark.timeout(240)
def test_an_anonymous_flood_of_large_streams_stays_within_the_budget(
    anonymous: ServerProcess,
) -> None:
    """One tenant may use the whole budget: the oldest finished streams are evicted for
    the newest, and an evicted stream is gone (404), as if its retention had ended."""
    ids: list[str] = []
    with httpx.Client(base_url=anonymous.base_url, timeout=60) as client:
        baseline = warm_baseline(client, anonymous)
        peak = baseline
        refused = 0
        while len(ids) < NUM_BIG_STREAMS:
            big = client.post("/v1/streams", json=BIG)
            if big.status_code == 201:
                ids.append(big.json()["id"])
            else:  # live streams fill the budget: the server's limit, so a 503
                assert big.status_code == 503, big.text
                assert big.json()["error"]["code"] == "overloaded"
                assert "retry-after" in big.headers
                refused += 1
                wait_until_all_ended(client, ids)
            peak = max(peak, anonymous.rss_bytes())
        wait_until_all_ended(client, ids)
        peak = max(peak, anonymous.rss_bytes())
        assert refused < NUM_BIG_STREAMS
        assert metric(client, "sluice_event_log_bytes") <= BUDGET_BYTES
        assert metric(client, 'sluice_streams_evicted_total{reason="log_memory"}') > 0
        # Which finished streams made room depends on when each finished (under load, the
        # first one may still have been live when the budget filled, and only trimmed):
        # the ones the server no longer knows are the evicted ones.
        gone = [i for i in ids if client.get(f"/v1/streams/{i}").status_code == 404]
        assert gone
        evicted = client.get(
            f"/v1/streams/{gone[0]}/events", headers={"Last-Event-ID": f"{gone[0]}:5"}
        )
        assert evicted.status_code == 404
        assert evicted.json()["error"]["code"] == "stream_not_found"
        assert client.get(f"/v1/streams/{ids[-1]}").json()["state"] == "finished"
    assert peak - baseline <= BUDGET_BYTES + RSS_OVERHEAD_BYTES, (peak - baseline) / MiB


@pytest.mark.timeout(120)
def test_an_anonymous_server_holds_more_live_streams_than_the_keyed_tenant_default() -> None:
    """Without keys the one tenant gets the server's ``--max-streams``, not the per-tenant
    default of 1,000 (the benchmarks hold 10,000 idle streams)."""
    idle = {"prompt": "a b c", "interval_ms": 60_000, "grace_s": 300}
    with pytest.MonkeyPatch.context() as env:
        env.delenv("SLUICE_API_KEYS", raising=False)
        server = ServerProcess("--no-model", "--max-streams", "1200").start()

    def create(count: int) -> list[int]:
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            return [client.post("/v1/streams", json=idle).status_code for _ in range(count)]

    try:
        server.wait_ready()
        # Ten clients at once: one alone waits about 40 ms a request on loopback (its
        # body's write waits for the ACK of its head, which the kernel delays).
        with ThreadPoolExecutor(10) as pool:
            statuses = [s for batch in pool.map(create, [100] * 10 + [1]) for s in batch]
        assert statuses == [201] * 1_001
        assert httpx.get(f"{server.base_url}/readyz").json()["streams"] == 1_001
    finally:
        server.close()


def test_per_tenant_defaults_follow_the_keys() -> None:
    keyed = Settings().hub_settings(multi_tenant=True)
    assert keyed.max_streams_per_tenant == 1_000
    assert keyed.max_retained_per_tenant == 10_000
    assert keyed.max_log_bytes_per_tenant == keyed.log_budget_bytes // 4 == 256 * MiB
    alone = Settings().hub_settings(multi_tenant=False)
    assert alone.max_streams_per_tenant == alone.max_retained_per_tenant == 100_000
    assert alone.max_log_bytes_per_tenant == alone.log_budget_bytes == 1024 * MiB
    explicit = Settings(max_streams_per_tenant=7).hub_settings(multi_tenant=False)
    assert explicit.max_streams_per_tenant == 7


def test_serve_reads_sizes_and_auto_for_the_memory_limits() -> None:
    def settings(*options: str) -> Settings:
        return _settings(build_parser().parse_args(["serve", *options]))

    assert settings().log_budget_bytes == 1024 * MiB
    assert settings().max_streams_per_tenant is None  # auto
    given = settings(
        "--log-memory-budget",
        "1.5GiB",
        "--max-log-bytes-per-tenant",
        "100",
        "--max-retained-streams-per-tenant",
        "50",
    )
    assert given.log_budget_bytes == 1536 * MiB
    assert given.max_log_bytes_per_tenant == 100 * MiB  # a bare number is MiB
    assert given.max_retained_streams_per_tenant == 50
    with pytest.raises(SystemExit):
        settings("--log-memory-budget", "lots")
