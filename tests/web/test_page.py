"""The browser page at ``/`` in real headless Chromium, against a real server.

Each test drives the page as a user would (pick a model, type, press buttons) and waits on
the DOM, never on the clock: the page mirrors its state in ``document.body.dataset.state``
and exposes ``window.sluiceArrivals`` (when each token arrived), ``window.sluiceDuplicates``
(tokens the server sent twice) and ``window.sluiceLastDrop`` (the drop endpoint's answer).

The ``words`` model echoes the prompt at a set pace, so its tests can assert the exact
text; the default model (the bundled ``sluice-tiny``) is checked for what any model's
stream must satisfy.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import pytest
from playwright.sync_api import Browser, Page, Route
from prometheus_client.parser import text_string_to_metric_families

from tests.server import ServerProcess

pytestmark = pytest.mark.browser

# Deadline for any single wait on the page, in milliseconds (generous: CI machines are busy).
WAIT_MS = 30_000

# The model the test server loads (tests/server.py), and the demo backend it always serves.
DEFAULT_MODEL = "sluice-tiny"
WORDS = "words"
# What the status pane shows for a value not known yet (an en dash).
NO_VALUE = "\u2013"
MODEL_PROMPT = "Return a new list containing all items from the iterable in ascending order."

# 20 words, with a double space, a newline and a tab that must come back exactly.
SHORT_TEXT = (
    "Tokens should  arrive one by one,\nas the model produces them,\t"
    "and the page must show them exactly as sent."
)
LONG_TEXT = " ".join(f"word{i:02d}" for i in range(60)) + "\nThe end."


def _words(text: str) -> int:
    return len(text.split())


@pytest.fixture
def page(browser: Browser, server: ServerProcess) -> Iterator[Page]:
    context = browser.new_context(base_url=server.base_url)
    context.set_default_timeout(WAIT_MS)
    page = context.new_page()
    page.goto("/")
    yield page
    context.close()


def _start_words(page: Page, text: str, interval_ms: int) -> None:
    page.select_option("#model", WORDS)
    page.fill("#prompt", text)
    page.fill("#interval", str(interval_ms))
    page.click("#start")


def _start_model(page: Page, prompt: str, max_tokens: int, temperature: float) -> None:
    """Start a stream from the model selected by default."""
    page.fill("#prompt", prompt)
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#temperature", str(temperature))
    page.click("#start")


def _text(page: Page, selector: str) -> str:
    return str(page.eval_on_selector(selector, "e => e.textContent"))


def _wait_state(page: Page, state: str) -> None:
    page.wait_for_function("s => document.body.dataset.state === s", arg=state)


def _wait_tokens(page: Page, at_least: int) -> None:
    page.wait_for_function(
        "n => document.body.dataset.state === 'streaming'"
        " && Number(document.getElementById('tokens').textContent) >= n",
        arg=at_least,
    )


def _stop_at_tokens(page: Page, count: int) -> None:
    """Click Stop from inside the page as soon as it shows ``count`` tokens: in the same
    JavaScript task that shows them, so a fast model cannot run to its end while a click
    travels from the test process to the browser."""
    page.evaluate(
        """n => {
            const tokens = document.getElementById('tokens');
            const observer = new MutationObserver(() => {
                if (Number(tokens.textContent) >= n) {
                    observer.disconnect();
                    document.getElementById('stop').click();
                }
            });
            observer.observe(tokens, {childList: true, characterData: true, subtree: true});
        }""",
        count,
    )


def test_page_streams_words_one_by_one_and_ends_with_the_exact_text(page: Page) -> None:
    assert page.title() == "Sluice"
    _start_words(page, SHORT_TEXT, 50)

    _wait_tokens(page, 3)
    partial = _text(page, "#output")
    assert partial
    assert SHORT_TEXT.startswith(partial)
    assert partial != SHORT_TEXT

    _wait_state(page, "done:stop")
    assert _text(page, "#state") == "done:stop"
    assert _text(page, "#output") == SHORT_TEXT
    assert _text(page, "#tokens") == str(_words(SHORT_TEXT))
    assert _text(page, "#reconnects") == "0"
    assert re.fullmatch(r"str_\w+", _text(page, "#stream-id"))
    ttft = re.fullmatch(r"(\d+) ms", _text(page, "#ttft"))
    total = re.fullmatch(r"(\d+) ms", _text(page, "#total"))
    assert ttft
    assert total
    assert int(ttft[1]) <= int(total[1])
    assert page.evaluate("window.sluiceDuplicates") == 0
    arrivals = page.evaluate("window.sluiceArrivals")
    assert len(arrivals) == _words(SHORT_TEXT)
    # 19 gaps of 50 ms: the words were delivered as they were produced, not in one burst.
    assert arrivals[-1] - arrivals[0] >= 500
    assert len({round(t / 20) for t in arrivals}) >= 10


def _drop_and_wait_for_reconnect(page: Page, reconnects: int) -> None:
    page.evaluate("window.sluiceLastDrop = null")
    page.click("#drop")
    page.wait_for_function("window.sluiceLastDrop !== null")
    assert page.evaluate("window.sluiceLastDrop.dropped") >= 1
    page.wait_for_function(
        "n => Number(document.getElementById('reconnects').textContent) >= n", arg=reconnects
    )


def test_page_resumes_after_server_drops_connection_twice_without_gap_or_duplicate(
    page: Page, server: ServerProcess
) -> None:
    num_words = _words(LONG_TEXT)
    _start_words(page, LONG_TEXT, 40)

    _wait_tokens(page, 10)
    _drop_and_wait_for_reconnect(page, 1)
    _wait_tokens(page, 35)
    _drop_and_wait_for_reconnect(page, 2)

    _wait_state(page, "done:stop")
    assert _text(page, "#output") == LONG_TEXT
    assert _text(page, "#tokens") == str(num_words)
    assert _text(page, "#reconnects") == "2"
    assert page.evaluate("window.sluiceDuplicates") == 0
    assert len(page.evaluate("window.sluiceArrivals")) == num_words

    stream_id = _text(page, "#stream-id")
    status = httpx.get(f"{server.base_url}/v1/streams/{stream_id}", timeout=5).json()
    assert status["state"] == "finished"
    assert status["tokens"] == num_words


def test_page_stop_cancels_the_stream_midway(page: Page, server: ServerProcess) -> None:
    num_words = _words(LONG_TEXT)
    coalesced = _coalesced(server)
    _start_words(page, LONG_TEXT, 50)

    _wait_tokens(page, 5)
    page.click("#stop")
    _wait_state(page, "done:cancelled")

    output = _text(page, "#output")
    assert output
    assert LONG_TEXT.startswith(output)
    assert output != LONG_TEXT
    shown_tokens = int(_text(page, "#tokens"))
    assert 5 <= shown_tokens < num_words
    assert page.evaluate("window.sluiceDuplicates") == 0

    url = f"{server.base_url}/v1/streams/{_text(page, '#stream-id')}"
    first = httpx.get(url, timeout=5).json()
    assert first["state"] == "cancelled"
    assert first["finish_reason"] == "cancelled"
    # Every token the server produced reached the page before ``done``; none came after.
    assert first["tokens"] == shown_tokens + _coalesced(server) - coalesced
    second = httpx.get(url, timeout=5).json()
    assert second["tokens"] == first["tokens"]
    assert second["events"] == first["events"]


def _coalesced(server: ServerProcess) -> float:
    """Token events the server has merged into others for lagging readers so far (a
    page whose connection lagged under load sees fewer, larger token events; with these
    every token is still accounted for)."""
    body = httpx.get(f"{server.base_url}/metrics", timeout=5).text
    for family in text_string_to_metric_families(body):
        if family.name == "sluice_sse_coalesced_events":
            return sum(sample.value for sample in family.samples)
    return 0.0


def _status(server: ServerProcess, stream_id: str) -> dict[str, object]:
    response = httpx.get(f"{server.base_url}/v1/streams/{stream_id}", timeout=5)
    response.raise_for_status()
    status: dict[str, object] = response.json()
    return status


def test_page_shows_a_refused_request_with_the_servers_error_code_and_message(
    page: Page,
) -> None:
    _start_words(page, SHORT_TEXT, -1)
    _wait_state(page, "error:invalid_request")
    assert "interval_ms" in _text(page, "#message")
    assert _text(page, "#output") == ""
    assert _text(page, "#stream-id") == NO_VALUE
    assert page.is_enabled("#start")
    assert page.is_disabled("#stop")


def test_page_shows_an_unreachable_server_as_a_connection_error(page: Page) -> None:
    page.route("**/v1/streams", lambda route: route.abort())
    _start_words(page, SHORT_TEXT, 50)
    _wait_state(page, "error:connection")
    assert _text(page, "#message")
    assert _text(page, "#output") == ""
    assert page.is_enabled("#start")
    assert page.is_disabled("#stop")


def test_page_offers_the_servers_models_with_the_default_model_selected(page: Page) -> None:
    page.wait_for_function("document.getElementById('model').options.length > 0")
    options = page.eval_on_selector_all("#model option", "os => os.map(o => o.value)")
    assert options[0] == DEFAULT_MODEL
    assert WORDS in options
    assert page.input_value("#model") == DEFAULT_MODEL
    assert page.input_value("#max-tokens") == "64"
    assert page.input_value("#temperature") == "0.8"


def _past_end_of_text(page: Page) -> None:
    """Make the page's stream requests run all their tokens (``ignore_eos``), so a test
    does not depend on where the bundled model happens to end a text."""

    def add_ignore_eos(route: Route) -> None:
        body = json.loads(route.request.post_data or "{}")
        route.continue_(post_data=json.dumps({**body, "ignore_eos": True}))

    page.route("**/v1/streams", add_ignore_eos)


def test_page_streams_the_default_models_tokens_until_max_tokens(
    page: Page, server: ServerProcess
) -> None:
    _past_end_of_text(page)
    page.wait_for_function("document.getElementById('model').options.length > 0")
    assert page.input_value("#model") == DEFAULT_MODEL
    coalesced = _coalesced(server)
    _start_model(page, MODEL_PROMPT, 24, 0)

    page.wait_for_function(
        "v => document.getElementById('stream-id').textContent !== v", arg=NO_VALUE
    )
    stream_id = _text(page, "#stream-id")
    assert re.fullmatch(r"str_\w+", stream_id)

    _wait_state(page, "done:length")
    output = _text(page, "#output")
    num_tokens = int(_text(page, "#tokens"))
    assert output
    assert "\ufffd" not in output
    # A token event can carry several model tokens (bytes of one character), never more.
    assert 0 < num_tokens <= 24
    assert _text(page, "#reconnects") == "0"
    assert _text(page, "#message") == ""
    assert re.fullmatch(r"\d+ ms", _text(page, "#ttft"))
    assert page.evaluate("window.sluiceDuplicates") == 0
    assert len(page.evaluate("window.sluiceArrivals")) == num_tokens

    status = _status(server, stream_id)
    assert status["model"] == DEFAULT_MODEL
    assert status["state"] == "finished"
    assert status["finish_reason"] == "length"
    assert status["tokens"] == num_tokens + _coalesced(server) - coalesced


def test_page_stop_cancels_a_model_stream_midway(page: Page, server: ServerProcess) -> None:
    _past_end_of_text(page)
    page.wait_for_function("document.getElementById('model').options.length > 0")
    _stop_at_tokens(page, 3)
    coalesced = _coalesced(server)
    _start_model(page, MODEL_PROMPT, 200, 0.8)
    _wait_state(page, "done:cancelled")

    shown_tokens = int(_text(page, "#tokens"))
    assert 3 <= shown_tokens < 200
    assert _text(page, "#output")
    assert page.evaluate("window.sluiceDuplicates") == 0
    status = _status(server, _text(page, "#stream-id"))
    assert status["state"] == "cancelled"
    assert status["finish_reason"] == "cancelled"
    assert status["tokens"] == shown_tokens + _coalesced(server) - coalesced
