"""Graceful drain on SIGTERM: ``/readyz`` turns 503 and new streams are refused with 503 +
``Retry-After`` while the listener stays open; streams that can finish within the drain
deadline finish completely; the others end on an event boundary with one retryable
``unavailable`` error; the process exits 0 soon after the deadline."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from urllib.parse import quote

import httpx
import orjson

from sluice.sse import Decoder, Event
from tests.rawhttp import RawResponse, open_get
from tests.server import ServerProcess

DRAIN_S = 10.0  # the case: 50 live streams, a 10 s drain deadline


def _first_token(response: RawResponse) -> tuple[Iterator[bytes], Decoder, list[Event]]:
    decoder = Decoder()
    events: list[Event] = []
    pieces = response.body()
    while not any(e.event == "token" for e in events):
        events += decoder.feed(next(pieces))
    return pieces, decoder, events


def test_sigterm_drains_live_streams_then_exits_zero() -> None:
    with ServerProcess("--no-model", "--drain-timeout", str(DRAIN_S)) as server:
        server.wait_ready()
        short_text = "s " * 20  # 20 x 100 ms: done well within the deadline
        long_text = "l " * 400  # 400 x 50 ms: cut by the deadline
        streams = []
        for text, interval in [(short_text, 100)] * 25 + [(long_text, 50)] * 25:
            target = f"/v1/demo/words?text={quote(text)}&interval_ms={interval}"
            response = open_get(server.port, target)
            streams.append((text, response, *_first_token(response)))
        assert server.process is not None
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)

        deadline = time.monotonic() + DRAIN_S
        while httpx.get(f"{server.base_url}/readyz").status_code == 200:
            assert time.monotonic() < deadline  # polling an observable condition
            time.sleep(0.01)
        refused = httpx.post(
            f"{server.base_url}/v1/streams", json={"model": "words", "prompt": "late"}
        )
        assert refused.status_code == 503
        assert int(refused.headers["retry-after"]) >= 1
        late_read = open_get(server.port, "/v1/demo/words?text=late&interval_ms=0")
        assert late_read.status == 200  # EventSource would give up on a 503: retry later
        assert late_read.sized_body().startswith(b"retry: ")
        late_read.close()

        for text, response, pieces, decoder, events in streams:
            events += decoder.feed(b"".join(pieces))
            response.close()
            terminal = [e for e in events if e.event in ("done", "error")]
            assert len(terminal) == 1
            assert events[-1] is terminal[0]
            tokens = "".join(orjson.loads(e.data)["text"] for e in events if e.event == "token")
            if text == short_text:
                assert terminal[0].event == "done"
                assert tokens == text
            else:
                assert terminal[0].event == "error"
                error = orjson.loads(terminal[0].data)
                assert error["code"] == "unavailable"
                assert error["retryable"] is True
                assert text.startswith(tokens)
                assert 0 < len(tokens) < len(text)
        assert server.process.wait(timeout=DRAIN_S + 10) == 0
        assert time.monotonic() - started < DRAIN_S + 2
