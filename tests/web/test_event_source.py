"""Chromium's own EventSource against a real server whose log keeps only 20 events.

A position the log no longer holds must stop EventSource for good (``readyState``
CLOSED), whether the server knows it when the read opens (``410``) or finds it while
reading (the in-band ``resume_gap`` event, then a reconnect that is a ``410``): never a
reconnect loop. Connections are counted on the server (``sluice_resumes_total``).

Once CLOSED, EventSource never reconnects (WHATWG HTML, section 9.2.3: "fail the
connection" sets CLOSED, and only CONNECTING schedules a reconnect), so waiting for CLOSED
with a deadline is the whole wait.
"""

from __future__ import annotations

from collections.abc import Iterator
from urllib.parse import quote

import httpx
import pytest
from playwright.sync_api import Browser, Page
from prometheus_client.parser import text_string_to_metric_families

from tests.server import ServerProcess, wait_for_state

pytestmark = pytest.mark.browser

WAIT_MS = 30_000
MAX_LOG_EVENTS = 20
RETRY_MS = 200
# More words than the log holds, and more than one unpaced burst (64 words).
TEXT = " ".join(f"w{i}" for i in range(100))

# Opens an EventSource and records what the page sees of it.
_OPEN = """url => {
    const seen = {opens: 0, tokens: 0, errors: []};
    const es = new EventSource(url);
    es.onopen = () => { seen.opens += 1; };
    es.addEventListener("token", () => { seen.tokens += 1; });
    es.addEventListener("error", (ev) => {
        seen.errors.push({data: ev.data === undefined ? null : ev.data, state: es.readyState});
    });
    window.seen = seen;
    window.es = es;
}"""


@pytest.fixture(scope="module")
def small_log() -> Iterator[ServerProcess]:
    options = ["--no-model", "--max-log-events", str(MAX_LOG_EVENTS), "--retry", str(RETRY_MS)]
    with ServerProcess(*options) as server:
        yield server.wait_ready()


@pytest.fixture
def page(browser: Browser, small_log: ServerProcess) -> Iterator[Page]:
    context = browser.new_context(base_url=small_log.base_url)
    context.set_default_timeout(WAIT_MS)
    page = context.new_page()
    page.goto("/")  # same origin as the streams
    yield page
    context.close()


def _counter(server: ServerProcess, name: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    return 0.0


def _wait_closed(page: Page) -> dict[str, object]:
    page.wait_for_function("window.es.readyState === EventSource.CLOSED")
    seen: dict[str, object] = page.evaluate("window.seen")
    return seen


def test_event_source_resuming_at_a_dropped_position_stops_at_once(
    page: Page, small_log: ServerProcess
) -> None:
    # Paced, so that its creation sees it start before the log drops its first events.
    created = httpx.post(
        f"{small_log.base_url}/v1/streams", json={"prompt": TEXT, "interval_ms": 1}
    ).json()
    wait_for_state(small_log, created["id"], "finished")
    resumes, gaps = (
        _counter(small_log, "sluice_resumes_total"),
        _counter(small_log, "sluice_resume_gaps_total"),
    )

    page.evaluate(_OPEN, f"{created['events_url']}&last_event_id={created['id']}:1")
    seen = _wait_closed(page)

    # The 410 came before any event: one failed connection, nothing delivered.
    assert seen == {"opens": 0, "tokens": 0, "errors": [{"data": None, "state": 2}]}
    assert _counter(small_log, "sluice_resumes_total") == resumes + 1
    assert _counter(small_log, "sluice_resume_gaps_total") == gaps + 1
    refused = httpx.get(
        f"{small_log.base_url}{created['events_url']}",
        headers={"Last-Event-ID": f"{created['id']}:1"},
    )
    assert refused.status_code == 410
    assert refused.json()["error"]["code"] == "resume_gap"


def test_event_source_that_falls_behind_the_log_stops_after_the_in_band_gap(
    page: Page, small_log: ServerProcess
) -> None:
    """The demo URL starts a new stream on every connection that names no position: the
    in-band event carries the reader's position as its id, so the reconnect names it."""
    resumes = _counter(small_log, "sluice_resumes_total")

    # Unpaced, a burst of 64 words lands in one append, past a 20-event log: the reader
    # finds its position gone on its first read after it.
    page.evaluate(_OPEN, f"/v1/demo/words?interval_ms=0&text={quote(TEXT)}")
    seen = _wait_closed(page)

    errors = seen["errors"]
    assert isinstance(errors, list)
    in_band = [error for error in errors if error["data"] is not None]
    assert len(in_band) == 1
    assert '"code":"resume_gap"' in in_band[0]["data"]
    assert errors[-1] == {"data": None, "state": 2}  # the reconnect, refused for good
    assert seen["opens"] == 1
    assert _counter(small_log, "sluice_resumes_total") == resumes + 1
