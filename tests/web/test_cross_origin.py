"""Pages on other origins, in real headless Chromium, against real servers.

``home`` is a default (anonymous) server; ``partner`` allows ``home``'s origin with
``--cors-origin``. A page on ``home`` may then call ``partner`` as the official JS SDKs
do (their headers included) and read its streams with EventSource; a page on ``partner``
gets nothing from ``home``, whose default is same-origin only. A DNS-rebound name (mapped to
127.0.0.1 by Chromium's resolver rules) gets ``421`` from ``home``.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from playwright.sync_api import Browser, Page, Playwright

from tests.server import ServerProcess
from tests.web.chromium import launch_chromium

pytestmark = pytest.mark.browser

WAIT_MS = 30_000
REBOUND = "rebound.test"
# What openai-node and @anthropic-ai/sdk send beside the body (values as they send them).
SDK_HEADERS = {
    "Content-Type": "application/json",
    "Authorization": "Bearer unused",
    "OpenAI-Organization": "org-test",
    "X-Stainless-Lang": "js",
    "X-Stainless-Package-Version": "6.49.0",
    "X-Stainless-OS": "Unknown",
    "X-Stainless-Arch": "unknown",
    "X-Stainless-Runtime": "browser:chrome",
    "X-Stainless-Runtime-Version": "156.0.0",
    "X-Stainless-Retry-Count": "0",
    "X-Stainless-Timeout": "600",
    "anthropic-dangerous-direct-browser-access": "true",
    "anthropic-version": "2023-06-01",
}


@pytest.fixture(scope="module")
def home() -> Iterator[ServerProcess]:
    with ServerProcess("--no-model") as server:
        yield server.wait_ready()


@pytest.fixture(scope="module")
def partner(home: ServerProcess) -> Iterator[ServerProcess]:
    with ServerProcess("--no-model", "--cors-origin", home.base_url) as server:
        yield server.wait_ready()


@pytest.fixture(scope="module")
def rebinding_browser(playwright: Playwright) -> Iterator[Browser]:
    """Chromium that resolves ``REBOUND`` to 127.0.0.1, as a rebound DNS name would."""
    browser = launch_chromium(playwright, [f"--host-resolver-rules=MAP {REBOUND} 127.0.0.1"])
    yield browser
    browser.close()


def _page_on(browser: Browser, server: ServerProcess) -> Iterator[Page]:
    context = browser.new_context()
    context.set_default_timeout(WAIT_MS)
    page = context.new_page()
    page.goto(f"{server.base_url}/")
    yield page
    context.close()


@pytest.fixture
def page_on_home(browser: Browser, home: ServerProcess) -> Iterator[Page]:
    yield from _page_on(browser, home)


@pytest.fixture
def page_on_partner(browser: Browser, partner: ServerProcess) -> Iterator[Page]:
    yield from _page_on(browser, partner)


def _held_streams(server: ServerProcess) -> int:
    streams: int = httpx.get(f"{server.base_url}/readyz").json()["streams"]
    return streams


def test_an_allowed_origin_calls_with_the_sdks_headers_and_reads_the_stream(
    page_on_home: Page, partner: ServerProcess
) -> None:
    answer = page_on_home.evaluate(
        """async ([base, headers]) => {
            const body = {model: "words", messages: [{role: "user", content: "a b c"}]};
            const chat = await fetch(base + "/v1/chat/completions",
                {method: "POST", headers, body: JSON.stringify(body)});
            const created = await (await fetch(base + "/v1/streams", {method: "POST",
                headers, body: JSON.stringify({prompt: "x y z", interval_ms: 0})})).json();
            const tokens = await new Promise((resolve, reject) => {
                const es = new EventSource(base + created.events_url);
                const seen = [];
                es.addEventListener("token", (ev) => seen.push(JSON.parse(ev.data).text));
                es.addEventListener("done", () => { es.close(); resolve(seen); });
                es.onerror = () => { es.close(); reject(new Error("EventSource failed")); };
            });
            return {
                status: chat.status,
                text: (await chat.json()).choices[0].message.content,
                streamId: chat.headers.get("x-sluice-stream-id"),
                tokens: tokens.join(""),
            };
        }""",
        [partner.base_url, SDK_HEADERS],
    )
    assert answer["status"] == 200
    assert answer["text"] == "a b c"
    assert answer["streamId"].startswith("str_")  # an exposed header
    assert answer["tokens"] == "x y z"


def test_a_page_on_another_origin_can_neither_write_nor_read_a_default_server(
    page_on_partner: Page, home: ServerProcess
) -> None:
    held = _held_streams(home)
    outcomes = page_on_partner.evaluate(
        """async (base) => {
            const attempt = async (init) => {
                try {
                    const response = await fetch(base + "/v1/streams", {method: "POST", ...init});
                    return "read " + response.status;
                } catch (error) {
                    return "blocked";
                }
            };
            const body = JSON.stringify({prompt: "a b", interval_ms: 0});
            return [
                // Needs a preflight, which is refused: the POST is never sent.
                await attempt({headers: {"Content-Type": "application/json"}, body}),
                // Simple requests (no preflight): sent, refused as not JSON, and unreadable.
                await attempt({headers: {"Content-Type": "text/plain"}, body}),
                await attempt({body: new Blob([body])}),
            ];
        }""",
        home.base_url,
    )
    assert outcomes == ["blocked", "blocked", "blocked"]
    assert _held_streams(home) == held  # not one stream was created


def test_a_dns_rebound_name_gets_421_from_a_default_server(
    rebinding_browser: Browser, home: ServerProcess
) -> None:
    context = rebinding_browser.new_context()
    context.set_default_timeout(WAIT_MS)
    page = context.new_page()
    try:
        response = page.goto(f"http://{REBOUND}:{home.port}/")
        assert response is not None
        assert response.status == 421
        status = page.evaluate(
            """async () => (await fetch("/v1/streams", {method: "POST",
                headers: {"Content-Type": "application/json"},
                body: JSON.stringify({prompt: "a"})})).status"""
        )
        assert status == 421
    finally:
        context.close()
