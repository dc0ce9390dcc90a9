"""``--access-log`` lines (text format, on stdout) quote the request path, on the native SSE path as uvicorn does on
its own: a percent-encoded CR LF in a path cannot forge a log line."""

from __future__ import annotations

import pytest

from tests.rawhttp import open_get
from tests.server import ServerProcess

FORGED = 'INFO:     127.0.0.1:1 - "GET /admin HTTP/1.1" 200 OK'
TARGET = (
    "/v1/streams/str_AAAAAAAAAAAAAAAAAAAAAA%0d%0aINFO:%20%20%20%20%20127.0.0.1:1%20-%20"
    "%22GET%20/admin%20HTTP/1.1%22%20200%20OK%0d%0a/events"
)


@pytest.mark.parametrize("native_sse", ["--native-sse", "--no-native-sse"])
def test_an_encoded_crlf_in_a_path_does_not_forge_an_access_log_line(
    capfd: pytest.CaptureFixture[str], native_sse: str
) -> None:
    options = ("--no-model", "--access-log", native_sse)
    with ServerProcess(*options, log_level="info") as server:
        server.wait_ready()
        response = open_get(server.port, TARGET)
        assert response.status == 400
        response.close()
        assert server.stop() == 0
    lines = capfd.readouterr().out.splitlines()  # text access lines go to its stdout
    assert not any(line.startswith(FORGED) for line in lines)
    logged = [line for line in lines if "/v1/streams/str_" in line]
    assert len(logged) == 1
    assert "%0D%0AINFO" in logged[0]


def test_the_http2_listener_leaves_the_access_log_on(capfd: pytest.CaptureFixture[str]) -> None:
    """Starting the HTTP/2 listener (its own uvicorn configuration, for HTTP/1.1 on its
    port) does not switch off the access log of the HTTP/1.1 port."""
    options = ("--no-model", "--access-log", "--http2-port", "0")
    with ServerProcess(*options, log_level="info") as server:
        server.wait_ready()
        response = open_get(server.port, "/v1/demo/words?text=logged&interval_ms=0")
        assert response.status == 200
        response.close()
        assert server.stop() == 0
    lines = capfd.readouterr().out.splitlines()
    assert any('"GET /v1/demo/words?text=logged&interval_ms=0 HTTP/1.1" 200' in x for x in lines)
