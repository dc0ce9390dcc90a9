"""Chromium over TLS with HTTP/2 (``sluice serve --http2``): eight EventSources on one
page, on one connection, all streaming at once (over HTTP/1.1 a browser opens at most six
connections to an origin, so the seventh would wait)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme
from playwright.sync_api import Browser

from tests.server import ServerProcess

pytestmark = pytest.mark.browser

WAIT_MS = 30_000
NUM_SOURCES = 8

# Opens NUM_SOURCES EventSources on slow streams and counts each one's tokens.
_OPEN = """count => {
    window.tokens = Array(count).fill(0);
    window.sources = [];
    for (let i = 0; i < count; i++) {
        const es = new EventSource(`/v1/demo/words?text=${"t+".repeat(50)}&interval_ms=200`);
        es.addEventListener("token", () => { window.tokens[i] += 1; });
        window.sources.push(es);
    }
}"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder: Path = tmp_path_factory.mktemp("tls")
    cert = trustme.CA().issue_cert("127.0.0.1")
    certfile, keyfile = folder / "cert.pem", folder / "key.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(certfile))
    cert.private_key_pem.write_to_path(str(keyfile))
    port = free_port()
    options = ["--no-model", "--http2-port", str(port)]
    options += ["--ssl-certfile", str(certfile), "--ssl-keyfile", str(keyfile)]
    with ServerProcess(*options) as server:
        server.wait_ready()
        yield f"https://127.0.0.1:{port}"


def test_eight_event_sources_stream_at_once_over_one_h2_connection(
    browser: Browser, tls_server: str
) -> None:
    # The certificate's CA was made for this test: the context is told to accept it.
    context = browser.new_context(base_url=tls_server, ignore_https_errors=True)
    context.set_default_timeout(WAIT_MS)
    page = context.new_page()
    try:
        response = page.goto("/")
        assert response is not None
        assert response.ok
        protocol = page.evaluate("performance.getEntriesByType('navigation')[0].nextHopProtocol")
        assert protocol == "h2"
        page.evaluate(_OPEN, NUM_SOURCES)
        # Each stream is paced at 5 tokens/s and holds 50: all eight are live at once
        # when every one of them has two tokens.
        page.wait_for_function("() => window.tokens.every(n => n >= 2)", timeout=WAIT_MS)
        live = page.evaluate("window.sources.filter(es => es.readyState === 1).length")
        assert live == NUM_SOURCES
        page.evaluate("window.sources.forEach(es => es.close())")
    finally:
        context.close()
