"""``sluice serve --max-connections N``: N connections inside a request are served; a
request on one more is refused as a full server (503 + ``Retry-After``; an SSE read a
``retry:`` hint), on the native SSE path as on the ASGI one."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sluice.sse import Decoder
from tests.rawhttp import open_get
from tests.server import ServerProcess

SLOW = "/v1/demo/words?text=" + "%20".join(["w"] * 100) + "&interval_ms=1000"


@pytest.mark.parametrize("native_sse", [True, False], ids=["native-sse", "asgi-sse"])
def test_a_request_beyond_max_connections_is_refused_until_one_closes(native_sse: bool) -> None:
    options = ["--no-model", "--max-connections", "2"]
    if not native_sse:
        options.append("--no-native-sse")
    with ServerProcess(*options) as server:
        server.wait_ready()
        held = [open_get(server.port, SLOW) for _ in range(2)]
        try:
            assert [response.status for response in held] == [200, 200]
            refused = httpx.get(f"{server.base_url}/healthz")
            assert refused.status_code == 503
            assert refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "overloaded"
            # EventSource treats a non-200 as final: an SSE read gets a retry: hint.
            sse = open_get(server.port, SLOW)
            body = sse.sized_body()
            sse.close()
            assert sse.status == 200
            assert body.startswith(b"retry: ")
            assert Decoder().feed(body) == []
            held.pop().close()
            deadline = time.monotonic() + 10
            while httpx.get(f"{server.base_url}/healthz").status_code != 200:
                assert time.monotonic() < deadline, "the closed connection's slot never freed"
                time.sleep(0.02)  # polling an observable condition with a deadline
            scraped = httpx.get(f"{server.base_url}/metrics").text
            refusals = [
                sample.value
                for family in text_string_to_metric_families(scraped)
                for sample in family.samples
                if sample.name == "sluice_admission_refusals_total"
                and sample.labels == {"reason": "max_connections"}
            ]
            assert len(refusals) == 1
            assert refusals[0] >= 2
        finally:
            for response in held:
                response.close()
