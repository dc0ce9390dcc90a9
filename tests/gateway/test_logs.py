"""``sluice serve --log-format json``: one JSON object per line on stderr, uvicorn's lines
included; with ``--access-log``, an access line per request (the native SSE path too) and
a stream line, with the stream's id, model and tenant, when a stream ends."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from sluice.sse import Decoder
from tests.rawhttp import open_get
from tests.server import ServerProcess


@pytest.mark.parametrize("native_sse", ["--native-sse", "--no-native-sse"])
def test_json_log_has_access_and_stream_lines(tmp_path: Path, native_sse: str) -> None:
    log_path = tmp_path / "stderr.log"
    options = ("--no-model", "--log-format", "json", "--access-log", native_sse)
    with ServerProcess(*options, log_level="info", stderr_path=log_path) as server:
        server.wait_ready()
        created = httpx.post(
            f"{server.base_url}/v1/streams", json={"model": "words", "prompt": "a b c"}
        ).json()
        response = open_get(server.port, str(created["events_url"]))
        events = Decoder().feed(b"".join(response.body()))
        response.close()
        assert events[-1].event == "done"
        assert server.stop() == 0
    lines = [json.loads(line) for line in log_path.read_text("utf-8").splitlines()]
    assert lines, "the server logged nothing"
    for line in lines:
        assert {"ts", "level", "logger", "message"} <= line.keys()
        assert line["ts"].endswith("Z")
    assert any(line["logger"] == "uvicorn.error" for line in lines)
    access = [line for line in lines if line["logger"] == "uvicorn.access"]
    requests = {(line["method"], line["path"].partition("?")[0], line["status"]) for line in access}
    assert ("POST", "/v1/streams", 201) in requests
    assert ("GET", f"/v1/streams/{created['id']}/events", 200) in requests
    ended = [line for line in lines if line["logger"] == "sluice.stream"]
    assert len(ended) == 1
    assert ended[0]["stream_id"] == created["id"]
    assert ended[0]["model"] == "words"
    assert ended[0]["tenant"] == "anonymous"
    assert ended[0]["outcome"] == "stop"
    assert ended[0]["tokens"] == 3
    assert ended[0]["e2e_s"] > 0


def test_stream_lines_need_the_access_log(tmp_path: Path) -> None:
    log_path = tmp_path / "stderr.log"
    options = ("--no-model", "--log-format", "json")
    with ServerProcess(*options, log_level="info", stderr_path=log_path) as server:
        server.wait_ready()
        response = open_get(server.port, "/v1/demo/words?text=a%20b&interval_ms=0")
        assert Decoder().feed(b"".join(response.body()))[-1].event == "done"
        response.close()
        assert server.stop() == 0
    lines = [json.loads(line) for line in log_path.read_text("utf-8").splitlines()]
    assert any(line["logger"] == "uvicorn.error" for line in lines)
    assert not [line for line in lines if line["logger"] in ("sluice.stream", "uvicorn.access")]
