"""The page's transport selector in real headless Chromium, against a real server: the
native stream over a WebSocket and by long-polling, with the exact text, resumed after the
server drops it, and stopped midway; the selector only applies to the native dialect.

As in tests/web/test_page.py, every wait is on the DOM (``document.body.dataset.state``,
the token count), never on the clock.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from playwright.sync_api import Browser, Page

from tests.server import ServerProcess

pytestmark = pytest.mark.browser

WAIT_MS = 30_000
TEXT = "Tokens should  arrive one by one,\nas the model produces them,\ton every transport."
LONG_TEXT = " ".join(f"word{i:02d}" for i in range(50)) + "\nThe end."
# A mark of each transport's frames on the wire pane.
WIRE_MARK = {"websocket": '"type":"event"', "longpoll": "GET poll?after="}
TRANSPORTS = list(WIRE_MARK)


@pytest.fixture
def page(browser: Browser, server: ServerProcess) -> Iterator[Page]:
    context = browser.new_context(base_url=server.base_url)
    context.set_default_timeout(WAIT_MS)
    page = context.new_page()
    page.goto("/")
    page.wait_for_function("document.getElementById('model').options.length > 0")
    yield page
    context.close()


def _start_words(page: Page, transport: str, text: str, interval_ms: int) -> None:
    page.select_option("#transport", transport)
    page.select_option("#model", "words")
    page.fill("#prompt", text)
    page.fill("#interval", str(interval_ms))
    page.click("#start")


def _text(page: Page, selector: str) -> str:
    return str(page.eval_on_selector(selector, "e => e.textContent"))


def _wait_state(page: Page, state: str) -> None:
    page.wait_for_function("s => document.body.dataset.state === s", arg=state)


def _wait_tokens(page: Page, at_least: int) -> None:
    page.wait_for_function(
        "n => Number(document.getElementById('tokens').textContent) >= n", arg=at_least
    )


def _drop(page: Page, transport: str) -> None:
    page.evaluate("window.sluiceLastDrop = null")
    page.click("#drop")
    page.wait_for_function("window.sluiceLastDrop !== null")
    # A long-poll client holds a reader only while a poll is held: a drop may fall between.
    least = 0 if transport == "longpoll" else 1
    assert page.evaluate("window.sluiceLastDrop.dropped") >= least


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_page_streams_words_over_the_transport_with_the_exact_text(
    page: Page, transport: str
) -> None:
    _start_words(page, transport, TEXT, 30)
    _wait_state(page, "done:stop")
    assert _text(page, "#output") == TEXT
    assert _text(page, "#tokens") == str(len(TEXT.split()))
    assert page.evaluate("window.sluiceDuplicates") == 0
    frames = page.eval_on_selector_all("#wire .frame", "fs => fs.map(f => f.textContent)")
    assert any(WIRE_MARK[transport] in frame for frame in frames)
    label = "Polls" if transport == "longpoll" else "Reconnects"
    assert _text(page, "#reconnects-label") == label


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_page_resumes_after_the_server_drops_it_without_gap_or_duplicate(
    page: Page, server: ServerProcess, transport: str
) -> None:
    _start_words(page, transport, LONG_TEXT, 40)
    _wait_tokens(page, 10)
    _drop(page, transport)
    _wait_tokens(page, 30)
    _drop(page, transport)
    _wait_state(page, "done:stop")
    assert _text(page, "#output") == LONG_TEXT
    assert page.evaluate("window.sluiceDuplicates") == 0
    assert len(page.evaluate("window.sluiceArrivals")) == len(LONG_TEXT.split())
    if transport == "websocket":
        assert _text(page, "#reconnects") == "2"  # a new socket after each drop
    status = httpx.get(f"{server.base_url}/v1/streams/{_text(page, '#stream-id')}").json()
    assert status["state"] == "finished"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_page_stop_cancels_the_stream_midway(
    page: Page, server: ServerProcess, transport: str
) -> None:
    _start_words(page, transport, LONG_TEXT, 50)
    _wait_tokens(page, 5)
    page.click("#stop")
    _wait_state(page, "done:cancelled")
    output = _text(page, "#output")
    assert LONG_TEXT.startswith(output)
    assert output != LONG_TEXT
    status = httpx.get(f"{server.base_url}/v1/streams/{_text(page, '#stream-id')}").json()
    assert status["state"] == "cancelled"
    assert status["tokens"] == int(_text(page, "#tokens"))


def test_the_transport_applies_to_the_native_dialect_only(page: Page) -> None:
    assert page.is_enabled("#transport")
    page.select_option("#dialect", "openai_chat")
    assert page.is_disabled("#transport")
    page.select_option("#dialect", "native")
    assert page.is_enabled("#transport")
