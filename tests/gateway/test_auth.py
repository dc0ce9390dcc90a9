"""API keys, tenants and resume tokens against real ``sluice serve`` processes with keys
configured (``--auth-config`` and ``$SLUICE_API_KEYS``), on both SSE delivery paths.

A missing or wrong key is 401 in the endpoint's dialect; another tenant's stream and a
forged, foreign or expired token get exactly the answer of a stream that does not exist.
"""

from __future__ import annotations

import hashlib
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from sluice.gateway.auth import ResumeTokens
from sluice.sse import Decoder
from tests.server import ServerProcess

KEY_A = "key-of-tenant-a-0123456789"
KEY_B = "key-of-tenant-b-0123456789"
KEY_C = "key-of-tenant-c-0123456789"
SECRET = "a-test-secret-of-enough-bytes"
UNKNOWN_STREAM = "str_0000000000000000000000"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module", params=["native-sse", "asgi-sse"])
def keyed(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """Tenants ``a`` (key by digest), ``b`` (key from the environment, named in the file)
    and ``c`` (``$SLUICE_API_KEYS``); no anonymous access; a known token secret."""
    config = tmp_path_factory.mktemp("auth") / "keys.toml"
    digest_a = hashlib.sha256(KEY_A.encode()).hexdigest()
    config.write_text(
        f'[[key]]\ntenant = "a"\nkey_sha256 = "{digest_a}"\n\n'
        '[[key]]\ntenant = "b"\nkey_env = "TEST_SLUICE_KEY_B"\n'
    )
    options = ["--no-model", "--auth-config", str(config), "--token-secret", SECRET]
    if request.param == "asgi-sse":
        options.append("--no-native-sse")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TEST_SLUICE_KEY_B", KEY_B)
        env.setenv("SLUICE_API_KEYS", f"c:{KEY_C}")
        proc = ServerProcess(*options).start()
    try:
        yield proc.wait_ready()
    finally:
        proc.close()


def create(server: ServerProcess, key: str, **fields: object) -> dict[str, object]:
    body = {"prompt": "one two three four", "interval_ms": 0, **fields}
    response = httpx.post(f"{server.base_url}/v1/streams", json=body, headers=bearer(key))
    assert response.status_code == 201, response.text
    created: dict[str, object] = response.json()
    return created


def tokens_of(body: bytes) -> list[str]:
    decoder = Decoder()
    events = [*decoder.feed(body), *decoder.close()]
    return [json.loads(e.data)["text"] for e in events if e.event == "token"]


def not_found_body(server: ServerProcess, stream_id: str, key: str) -> str:
    """What an unknown stream id gets, with that id replaced by ``stream_id``."""
    response = httpx.get(f"{server.base_url}/v1/streams/{UNKNOWN_STREAM}", headers=bearer(key))
    assert response.status_code == 404
    return response.text.replace(UNKNOWN_STREAM, stream_id)


# ---------------------------------------------------------------------- 401


def test_native_create_read_cancel_without_or_with_a_wrong_key_is_401(
    keyed: ServerProcess,
) -> None:
    created = create(keyed, KEY_A, interval_ms=2000)
    stream = f"{keyed.base_url}/v1/streams/{created['id']}"
    for headers in ({}, bearer("wrong"), {"Authorization": "Basic Zm9vOmJhcg=="}):
        answers = [
            httpx.get(f"{keyed.base_url}/v1/models", headers=headers),
            httpx.post(f"{keyed.base_url}/v1/streams", json={"prompt": "a"}, headers=headers),
            httpx.get(f"{stream}/events", headers=headers),
            httpx.get(stream, headers=headers),
            httpx.post(f"{stream}/cancel", headers=headers),
            httpx.post(f"{stream}/drop", headers=headers),
        ]
        for response in answers:
            assert response.status_code == 401, (headers, response.request.url)
            assert response.headers["www-authenticate"].startswith("Bearer")
            assert response.json()["error"]["type"] == "authentication_error"
    # A wrong key is refused even beside a valid token: a bad credential never passes.
    token = created["resume_token"]
    wrong_with_token = httpx.get(f"{stream}?token={token}", headers=bearer("wrong"))
    assert wrong_with_token.status_code == 401
    assert httpx.get(stream, headers=bearer(KEY_A)).json()["state"] == "running"
    for path in ("/", "/healthz", "/readyz", "/metrics"):
        assert httpx.get(f"{keyed.base_url}{path}").status_code == 200, path


def test_openai_sdk_with_a_wrong_key_raises_authentication_error(keyed: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{keyed.base_url}/v1", api_key="wrong", max_retries=0)
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [
        {"role": "user", "content": "hi there"}
    ]
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model="words", messages=messages)
    with pytest.raises(openai.AuthenticationError):
        client.completions.create(model="words", prompt="hi", stream=True)
    good = openai.OpenAI(base_url=f"{keyed.base_url}/v1", api_key=KEY_C, max_retries=0)
    answer = good.chat.completions.create(model="words", messages=messages)
    assert answer.choices[0].message.content


def test_anthropic_sdk_with_a_wrong_key_raises_authentication_error(
    keyed: ServerProcess,
) -> None:
    messages: list[anthropic.types.MessageParam] = [{"role": "user", "content": "hi there"}]
    client = anthropic.Anthropic(base_url=keyed.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        client.messages.create(model="words", max_tokens=5, messages=messages)
    raw = httpx.post(
        f"{keyed.base_url}/v1/messages",
        json={"model": "words", "max_tokens": 5, "messages": messages},
    )
    assert raw.status_code == 401
    assert raw.json()["type"] == "error"
    assert raw.json()["error"]["type"] == "authentication_error"
    good = anthropic.Anthropic(base_url=keyed.base_url, api_key=KEY_B, max_retries=0)  # x-api-key
    with good.messages.stream(model="words", max_tokens=5, messages=messages) as stream:
        assert "".join(stream.text_stream).strip()


# ---------------------------------------------------------------------- tenants


def test_another_tenant_gets_exactly_the_answer_of_an_unknown_stream(
    keyed: ServerProcess,
) -> None:
    created = create(keyed, KEY_A, interval_ms=2000)
    stream_id = str(created["id"])
    stream = f"{keyed.base_url}/v1/streams/{stream_id}"
    expected = not_found_body(keyed, stream_id, KEY_B)
    answers = [
        httpx.get(f"{stream}/events", headers=bearer(KEY_B)),
        httpx.get(f"{stream}/events", headers={**bearer(KEY_B), "Last-Event-ID": f"{stream_id}:1"}),
        httpx.get(stream, headers=bearer(KEY_B)),
        httpx.post(f"{stream}/cancel", headers=bearer(KEY_B)),
        httpx.post(f"{stream}/drop", headers=bearer(KEY_B)),
    ]
    for response in answers:
        assert response.status_code == 404, response.request.url
        assert response.text == expected
    owner = httpx.get(stream, headers=bearer(KEY_A)).json()
    assert owner["state"] == "running"  # B's cancel did nothing
    assert httpx.post(f"{stream}/cancel", headers=bearer(KEY_A)).status_code == 202


def test_the_owner_reads_with_its_key_and_no_token(keyed: ServerProcess) -> None:
    created = create(keyed, KEY_A)
    body = httpx.get(
        f"{keyed.base_url}/v1/streams/{created['id']}/events", headers=bearer(KEY_A)
    ).content
    assert "".join(tokens_of(body)) == "one two three four"


# ---------------------------------------------------------------------- tokens


def test_the_events_url_token_reads_and_resumes_without_a_key(keyed: ServerProcess) -> None:
    created = create(keyed, KEY_A)
    stream_id = created["id"]
    events_url = f"{keyed.base_url}{created['events_url']}"
    assert f"token={created['resume_token']}" in events_url
    whole = httpx.get(events_url)  # what EventSource does: no headers of its own
    assert whole.status_code == 200
    assert "".join(tokens_of(whole.content)) == "one two three four"
    resumed = httpx.get(events_url, headers={"Last-Event-ID": f"{stream_id}:3"})
    assert resumed.status_code == 200
    assert "".join(tokens_of(resumed.content)) == " three four"
    described = httpx.get(
        f"{keyed.base_url}/v1/streams/{stream_id}?token={created['resume_token']}"
    )
    assert described.json()["state"] == "finished"


def test_the_token_cancels_in_a_header_or_the_query(keyed: ServerProcess) -> None:
    created = create(keyed, KEY_A, interval_ms=2000)
    token = str(created["resume_token"])
    cancel = f"{keyed.base_url}{created['cancel_url']}"
    assert httpx.post(cancel, headers={"X-Sluice-Resume-Token": token}).status_code == 202
    assert httpx.post(f"{cancel}?token={token}").status_code == 202


def test_forged_foreign_and_expired_tokens_get_the_unknown_stream_answer(
    keyed: ServerProcess,
) -> None:
    created = create(keyed, KEY_A, interval_ms=2000)
    other = create(keyed, KEY_A, interval_ms=2000)
    stream_id = str(created["id"])
    token = str(created["resume_token"])
    expiry, _, mac = token.partition(".")
    forged = [
        f"{expiry}.{'A' if mac[0] != 'A' else 'B'}{mac[1:]}",  # one character of the MAC
        f"{int(expiry) + 1}.{mac}",  # a later expiry under the same MAC
        str(other["resume_token"]),  # a genuine token for another stream
        ResumeTokens(SECRET.encode()).mint(stream_id, expires_at=time.time() - 5),  # expired
        ResumeTokens(b"another-secret-of-enough-bytes").mint(stream_id),  # another secret
        "not-a-token",
        "9" * 200,
    ]
    expected = not_found_body(keyed, stream_id, KEY_A)
    stream = f"{keyed.base_url}/v1/streams/{stream_id}"
    for bad in forged:
        for response in (
            httpx.get(f"{stream}/events", params={"token": bad}),
            httpx.get(stream, params={"token": bad}),
            httpx.post(f"{stream}/cancel", params={"token": bad}),
        ):
            assert response.status_code == 404, (bad, response.request.url)
            assert response.text == expected
    # The same secret mints a working token in-process: the server checks only the MAC.
    fresh = ResumeTokens(SECRET.encode()).mint(stream_id)
    assert httpx.get(stream, params={"token": fresh}).json()["state"] == "running"


def test_a_compatible_stream_resumes_with_its_header_token_and_no_key(
    keyed: ServerProcess,
) -> None:
    body = {
        "model": "words",
        "messages": [{"role": "user", "content": "alpha beta gamma"}],
        "stream": True,
    }
    headers = {**bearer(KEY_C), "X-Sluice-Resumable": "true"}
    with httpx.stream(
        "POST", f"{keyed.base_url}/v1/chat/completions", json=body, headers=headers
    ) as response:
        assert response.status_code == 200
        stream_id = response.headers["x-sluice-stream-id"]
        token = response.headers["x-sluice-resume-token"]
        first = response.read()
    assert b"[DONE]" in first
    resumed = httpx.get(
        f"{keyed.base_url}/v1/streams/{stream_id}/events",
        params={"token": token},
        headers={"Last-Event-ID": f"{stream_id}:1"},
    )
    assert resumed.status_code == 200
    assert b"[DONE]" in resumed.content
    no_token = httpx.get(f"{keyed.base_url}/v1/streams/{stream_id}/events")
    assert no_token.status_code == 401


# ---------------------------------------------------------------------- heads


def test_oversized_headers_are_431_and_a_long_url_414(server: ServerProcess) -> None:
    big = {f"x-filler-{i}": "v" * 1000 for i in range(20)}  # ~20 KiB of header lines
    for path in ("/v1/models", "/v1/streams/str_0000000000000000000000/events"):
        response = httpx.get(f"{server.base_url}{path}", headers=big)
        assert response.status_code == 431, path
        assert response.json()["error"]["code"] == "headers_too_large"
        long_url = httpx.get(f"{server.base_url}{path}?pad={'p' * 9000}")
        assert long_url.status_code == 414, path
        assert long_url.json()["error"]["code"] == "url_too_long"
    within = httpx.get(
        f"{server.base_url}/v1/models?pad={'p' * 7000}",
        headers={f"x-filler-{i}": "v" * 1000 for i in range(14)},
    )
    assert within.status_code == 200


def test_an_endless_header_line_is_cut_off_while_it_arrives() -> None:
    """The native protocol answers 431 before an unfinished header line is buffered whole."""
    with ServerProcess("--no-model") as server:
        server.wait_ready()
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Endless: ")
            answer = b""
            try:
                for _ in range(64):  # up to 4 MiB; the server answers after ~90 KiB
                    sock.sendall(b"v" * 65536)
            except (BrokenPipeError, ConnectionResetError):
                pass
            try:
                while chunk := sock.recv(65536):
                    answer += chunk
            except ConnectionResetError:
                pass
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:100]


def test_with_every_caller_keyed_any_origin_may_call_and_any_host_is_served(
    keyed: ServerProcess,
) -> None:
    """A page on another origin holds no key, and a rebound one neither: CORS is open to
    every origin by default and ``Host`` is not restricted."""
    origin = "http://elsewhere.example"
    preflight = httpx.options(
        f"{keyed.base_url}/v1/chat/completions",
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",
        },
    )
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == "*"
    assert preflight.headers["access-control-allow-headers"] == (
        "authorization, content-type, x-stainless-os"
    )
    somewhere = {"Origin": origin, "Host": "sluice.somewhere.example"}
    created = httpx.post(
        f"{keyed.base_url}/v1/streams",
        json={"prompt": "a b", "interval_ms": 0},
        headers={**bearer(KEY_A), **somewhere},
    )
    assert created.status_code == 201
    events = httpx.get(f"{keyed.base_url}{created.json()['events_url']}", headers=somewhere)
    assert events.status_code == 200
    assert "".join(tokens_of(events.content)) == "a b"
    for response in (created, events):
        assert response.headers["access-control-allow-origin"] == "*"


# ---------------------------------------------------------------------- start-up


def _serve_once(*options: str) -> subprocess.CompletedProcess[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    with sock:
        command = [sys.executable, "-m", "sluice.cli", "serve", "--fd", str(sock.fileno())]
        return subprocess.run(
            [*command, *options],
            pass_fds=(sock.fileno(),),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )


def test_no_keys_on_a_public_host_refuses_to_start() -> None:
    result = _serve_once("--host", "0.0.0.0", "--no-model")
    assert result.returncode == 2
    assert "no API keys configured" in result.stderr
    assert "--allow-anonymous" in result.stderr


def test_bad_auth_configuration_refuses_to_start(tmp_path: Path) -> None:
    config = tmp_path / "keys.toml"
    config.write_text('[[key]]\ntenant = "a"\nkey_env = "TEST_SLUICE_UNSET_VARIABLE"\n')
    unset = _serve_once("--no-model", "--auth-config", str(config))
    assert unset.returncode == 2
    assert "TEST_SLUICE_UNSET_VARIABLE" in unset.stderr
    short = _serve_once("--no-model", "--token-secret", "short")
    assert short.returncode == 2
    assert "token secret" in short.stderr


def test_the_default_server_says_it_is_anonymous() -> None:
    # ServerProcess does not capture output: start one that does, stop it once it spoke.
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    with sock:
        command = [sys.executable, "-m", "sluice.cli", "serve", "--fd", str(sock.fileno())]
        with subprocess.Popen(
            [*command, "--no-model", "--log-level", "warning"],
            pass_fds=(sock.fileno(),),
            stdout=subprocess.PIPE,
            text=True,
        ) as process:
            try:
                assert process.stdout is not None
                lines = [process.stdout.readline(), process.stdout.readline()]
            finally:
                process.terminate()
                process.wait(timeout=10)
    assert any("anonymous mode" in line for line in lines), lines
