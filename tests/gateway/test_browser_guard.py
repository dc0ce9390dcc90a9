"""What a web page may do to a server it can reach, on both SSE delivery paths.

An anonymous server (no keys, on loopback: the default) answers only its own origin
(no CORS headers for others, their preflights refused), reads only bodies declared JSON
(so every cross-origin write needs a preflight) and only loopback ``Host`` names (so a
DNS-rebound page gets nothing). ``--cors-origin`` and ``--allowed-host`` open it to named
origins and to a proxy's host name; with keys, see ``test_auth.py``.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from tests.server import ServerProcess, wait_for_state

EVIL = "http://evil.example"
APP = "http://app.example:3000"
PROXY_HOST = "sluice.example"
# What the official JS SDKs ask a preflight for (openai-node, @anthropic-ai/sdk).
SDK_HEADERS = (
    "anthropic-dangerous-direct-browser-access, anthropic-version, authorization, "
    "content-type, openai-organization, x-api-key, x-stainless-arch, x-stainless-lang, "
    "x-stainless-os, x-stainless-package-version, x-stainless-retry-count, "
    "x-stainless-runtime, x-stainless-runtime-version, x-stainless-timeout"
)


def _preflight(base_url: str, path: str, origin: str, headers: str = "") -> httpx.Response:
    request_headers = {"Origin": origin, "Access-Control-Request-Method": "POST"}
    if headers:
        request_headers["Access-Control-Request-Headers"] = headers
    return httpx.options(f"{base_url}{path}", headers=request_headers)


def _finished_stream(server: ServerProcess) -> dict[str, str]:
    response = httpx.post(
        f"{server.base_url}/v1/streams",
        json={"model": "words", "prompt": "a b c", "interval_ms": 0},
    )
    assert response.status_code == 201, response.text
    created: dict[str, str] = response.json()
    wait_for_state(server, created["id"], "finished")
    return created


def test_an_anonymous_server_answers_other_origins_without_cors_and_refuses_preflights(
    server: ServerProcess,
) -> None:
    created = httpx.post(
        f"{server.base_url}/v1/streams",
        json={"model": "words", "prompt": "a b", "interval_ms": 0},
        headers={"Origin": EVIL},
    )
    assert created.status_code == 201  # a script on EVIL could not read it
    events = httpx.get(f"{server.base_url}{created.json()['events_url']}", headers={"Origin": EVIL})
    assert events.status_code == 200
    for response in (created, events):
        assert "access-control-allow-origin" not in response.headers
    for path in ("/v1/streams", "/v1/chat/completions", "/v1/streams/x/events"):
        refused = _preflight(server.base_url, path, EVIL, "content-type")
        assert refused.status_code == 403, path
        assert refused.json()["error"]["code"] == "cors_refused"
        assert "access-control-allow-origin" not in refused.headers


@pytest.mark.parametrize(
    "content_type",
    [
        None,
        "text/plain",
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/json; charset=iso-8859-1",
        "json",
    ],
)
def test_bodies_not_declared_json_are_415_in_each_apis_error_shape(
    server: ServerProcess, content_type: str | None
) -> None:
    headers = {} if content_type is None else {"Content-Type": content_type}
    body = b'{"model": "words", "prompt": "a", "max_tokens": 4, "messages": []}'
    for path in ("/v1/streams", "/v1/chat/completions", "/v1/completions", "/v1/messages"):
        response = httpx.post(f"{server.base_url}{path}", content=body, headers=headers)
        assert response.status_code == 415, (path, response.text)
        assert response.headers["accept"] == "application/json"
        payload = response.json()
        if path == "/v1/messages":
            assert payload["type"] == "error"
            assert payload["error"]["type"] == "invalid_request_error"
            message = payload["error"]["message"]
        else:
            assert payload["error"]["type"] == "invalid_request_error"
            message = payload["error"]["message"]
        assert "application/json" in message or "UTF-8" in message


@pytest.mark.parametrize(
    "content_type",
    [
        "application/json",
        "Application/JSON; charset=utf-8",
        'application/json;charset="UTF-8"',
        "application/vnd.sluice+json",
    ],
)
def test_json_bodies_may_say_utf8_or_use_a_plus_json_type(
    server: ServerProcess, content_type: str
) -> None:
    body = b'{"model": "words", "prompt": "a b", "interval_ms": 0}'
    response = httpx.post(
        f"{server.base_url}/v1/streams", content=body, headers={"Content-Type": content_type}
    )
    assert response.status_code == 201, response.text


def test_foreign_host_names_are_421_on_every_path_and_loopback_names_are_served(
    server: ServerProcess,
) -> None:
    created = _finished_stream(server)
    port = server.port
    gets = [
        "/",
        "/healthz",
        "/metrics",
        "/v1/models",
        f"/v1/streams/{created['id']}",
        created["events_url"],  # the native fast path, or the ASGI one
        "/v1/demo/words?text=a&interval_ms=0",
    ]
    for host in (
        "attacker.rebind.example",
        f"attacker.rebind.example:{port}",
        "127.0.0.1.evil",
        "localhost.evil.example",
        "10.0.0.1",
        "[::2]",
        "::1",
        "bad host",
    ):
        for path in gets:
            response = httpx.get(f"{server.base_url}{path}", headers={"Host": host})
            assert response.status_code == 421, (host, path, response.status_code)
            assert response.json()["error"]["code"] == "misdirected_request"
        response = httpx.post(
            f"{server.base_url}/v1/streams", json={"prompt": "a"}, headers={"Host": host}
        )
        assert response.status_code == 421
        preflight = httpx.options(
            f"{server.base_url}/v1/streams",
            headers={"Host": host, "Origin": EVIL, "Access-Control-Request-Method": "POST"},
        )
        assert preflight.status_code == 421
    for host in (
        "localhost",
        f"localhost:{port}",
        "LocalHost.",
        "app.localhost:1",
        "127.0.0.1",
        f"127.9.8.7:{port}",
        f"[::1]:{port}",
        "[::1]",
    ):
        for path in gets[:-1]:
            response = httpx.get(f"{server.base_url}{path}", headers={"Host": host})
            assert response.status_code in (200, 204), (host, path, response.status_code)


@pytest.fixture(scope="module", params=["native-sse", "asgi-sse"])
def opened(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    """An anonymous server behind a proxy named ``PROXY_HOST``, called from ``APP``."""
    options = [
        "--no-model",
        "--allowed-host",
        PROXY_HOST,
        "--allowed-host",
        ".internal.example",
        "--cors-origin",
        APP,
    ]
    if request.param == "asgi-sse":
        options.append("--no-native-sse")
    with ServerProcess(*options) as server:
        yield server.wait_ready()


def test_allowed_hosts_are_served_besides_loopback_names(opened: ServerProcess) -> None:
    created = _finished_stream(opened)
    for host in (
        PROXY_HOST,
        f"{PROXY_HOST}:443",
        "internal.example",
        "a.b.internal.example",
        "localhost",
        "127.0.0.1",
    ):
        for path in ("/healthz", created["events_url"]):
            response = httpx.get(f"{opened.base_url}{path}", headers={"Host": host})
            assert response.status_code == 200, (host, path)
    for host in ("evil.example", f"x{PROXY_HOST}", "internal.example.evil"):
        response = httpx.get(f"{opened.base_url}/healthz", headers={"Host": host})
        assert response.status_code == 421, host


def test_a_named_origin_may_send_the_sdks_headers_and_read_every_answer(
    opened: ServerProcess,
) -> None:
    for path in ("/v1/chat/completions", "/v1/messages", "/v1/streams", "/v1/streams/x/events"):
        allowed = _preflight(opened.base_url, path, APP, SDK_HEADERS)
        assert allowed.status_code == 204, (path, allowed.text)
        assert allowed.headers["access-control-allow-origin"] == APP
        assert allowed.headers["access-control-allow-headers"] == SDK_HEADERS
        assert "POST" in allowed.headers["access-control-allow-methods"]
        assert "Origin" in allowed.headers["vary"]
        assert _preflight(opened.base_url, path, EVIL, SDK_HEADERS).status_code == 403
    # The answers themselves: JSON, the SSE read (fast path or not), errors.
    created = httpx.post(
        f"{opened.base_url}/v1/streams",
        json={"prompt": "a b", "interval_ms": 0},
        headers={"Origin": APP},
    )
    assert created.status_code == 201
    events_url = created.json()["events_url"]
    answers = [
        created,
        httpx.get(f"{opened.base_url}{events_url}", headers={"Origin": APP}),
        httpx.get(f"{opened.base_url}/v1/demo/words?text=a&interval_ms=0", headers={"Origin": APP}),
        httpx.get(f"{opened.base_url}/v1/nowhere", headers={"Origin": APP}),
        httpx.post(f"{opened.base_url}/v1/chat/completions", json={}, headers={"Origin": APP}),
        # The SSE reads' own errors (a fetch-based SSE client reads their bodies).
        httpx.get(f"{opened.base_url}/v1/streams/str_nope/events", headers={"Origin": APP}),
        httpx.get(f"{opened.base_url}/v1/streams/str_{'A' * 22}/events", headers={"Origin": APP}),
        httpx.get(f"{opened.base_url}/v1/demo/words?interval_ms=x", headers={"Origin": APP}),
    ]
    assert [answer.status_code for answer in answers[-3:]] == [400, 404, 400]
    for answer in answers:
        assert answer.headers["access-control-allow-origin"] == APP, answer.request.url
        assert "Origin" in answer.headers["vary"]
    assert "X-Sluice-Resume-Token" in created.headers["access-control-expose-headers"]
    foreign = httpx.get(f"{opened.base_url}{events_url}", headers={"Origin": EVIL})
    assert "access-control-allow-origin" not in foreign.headers


def _serve_once(*options: str) -> subprocess.CompletedProcess[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    with sock:
        command = [sys.executable, "-m", "sluice.cli", "serve", "--fd", str(sock.fileno())]
        return subprocess.run(
            [*command, "--no-model", *options],
            pass_fds=(sock.fileno(),),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("--cors-origin", "http://app.example/", "no trailing slash"),
        ("--cors-origin", "app.example", "scheme://host"),
        ("--allowed-host", "sluice.example:8000", "without port"),
        ("--allowed-host", "http://sluice.example", "host name"),
    ],
)
def test_a_cors_origin_or_allowed_host_no_request_could_match_refuses_to_start(
    option: str, value: str, says: str
) -> None:
    result = _serve_once(option, value)
    assert result.returncode == 2
    assert says in result.stderr
    assert value in result.stderr
