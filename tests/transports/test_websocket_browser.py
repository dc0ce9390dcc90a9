"""Headless Chromium's own ``WebSocket`` against a real server: a page opens ``/v1/ws``
from its own origin, creates a stream and receives its tokens; a socket it drops is
resumed on a new one from the last id, without gap or duplicate."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from tests.server import ServerProcess
from tests.web.chromium import launch_chromium

pytestmark = pytest.mark.browser

WAIT_MS = 30_000
TEXT = " ".join(f"word{i}" for i in range(30))

# Opens a WebSocket to the page's own origin and records every message it gets.
_OPEN = """() => new Promise((resolve, reject) => {
    const url = location.origin.replace(/^http/, "ws") + "/v1/ws";
    const ws = new WebSocket(url);
    window.seen = [];
    ws.onmessage = (ev) => window.seen.push(JSON.parse(ev.data));
    ws.onopen = () => resolve(true);
    ws.onerror = () => reject(new Error("the socket did not open"));
    window.ws = ws;
})"""


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess("--no-model") as proc:
        yield proc.wait_ready()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as driver:
        browser = launch_chromium(driver)
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Browser, server: ServerProcess) -> Iterator[Page]:
    context = browser.new_context(base_url=server.base_url)
    context.set_default_timeout(WAIT_MS)
    page = context.new_page()
    page.goto("/")  # the page's origin is the server's
    yield page
    context.close()


def _send(page: Page, message: dict[str, object]) -> None:
    page.evaluate("m => window.ws.send(JSON.stringify(m))", message)


def _tokens(page: Page) -> str:
    text: str = page.evaluate(
        """() => window.seen.filter(m => m.type === "event" && m.event === "token")
                   .map(m => m.data.text).join("")"""
    )
    return text


def test_a_page_opens_a_websocket_from_its_origin_and_receives_the_tokens(page: Page) -> None:
    page.evaluate(_OPEN)
    request = {"model": "words", "prompt": TEXT, "interval_ms": 10}
    _send(page, {"type": "create", "request": request})
    page.wait_for_function("() => window.seen.some(m => m.type === 'event' && m.event === 'done')")
    kinds = page.evaluate("() => window.seen.map(m => m.type + ':' + (m.event || ''))")
    assert kinds[0] == "created:"
    assert kinds[1] == "event:start"
    assert kinds[-2:] == ["event:usage", "event:done"]
    assert _tokens(page) == TEXT


def test_a_page_resumes_on_a_new_websocket_from_the_last_id(page: Page) -> None:
    page.evaluate(_OPEN)
    request = {"model": "words", "prompt": TEXT, "interval_ms": 30, "grace_s": 30}
    _send(page, {"type": "create", "request": request})
    page.wait_for_function(
        "() => window.seen.filter(m => m.type === 'event' && m.event === 'token').length >= 5"
    )
    page.evaluate(
        "() => { window.before = window.seen; window.ws.onmessage = null; window.ws.close(); }"
    )
    last = page.evaluate("() => window.before.filter(m => m.type === 'event').at(-1)")
    page.evaluate(_OPEN)
    _send(page, {"type": "subscribe", "stream_id": last["stream_id"], "last_event_id": last["id"]})
    page.wait_for_function("() => window.seen.some(m => m.event === 'done')")
    ids = page.evaluate(
        """() => [...window.before, ...window.seen]
                   .filter(m => m.type === "event").map(m => Number(m.id.split(":")[1]))"""
    )
    # What the first socket delivered after the close was asked for is dropped (its handler
    # is gone): the new socket's replay starts right after the last event the page has.
    assert ids == list(range(1, len(ids) + 1))
    text = page.evaluate(
        """() => [...window.before, ...window.seen]
                   .filter(m => m.type === "event" && m.event === "token")
                   .map(m => m.data.text).join("")"""
    )
    assert text == TEXT
