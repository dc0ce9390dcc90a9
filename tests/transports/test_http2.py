"""HTTP/2 beside HTTP/1.1 (``sluice serve --http2``) with real clients: curl with prior
knowledge, httpx over h2c and over TLS (ALPN), and a raw ``h2`` connection whose one
stalled stream must not stall the other."""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import httpx
import pytest
import trustme

from sluice.sse import Decoder
from tests.server import ServerProcess

WAIT_S = 30.0
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "upgrade", "proxy-connection"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class H2Server:
    def __init__(self, server: ServerProcess, port: int, scheme: str) -> None:
        self.server = server
        self.port = port
        self.url = f"{scheme}://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def h2c() -> Iterator[H2Server]:
    port = free_port()
    with ServerProcess("--no-model", "--http2-port", str(port)) as server:
        server.wait_ready()
        yield H2Server(server, port, "http")


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def tls(ca: trustme.CA, tmp_path_factory: pytest.TempPathFactory) -> Iterator[H2Server]:
    folder = tmp_path_factory.mktemp("tls")
    cert = ca.issue_cert("127.0.0.1", "localhost")
    certfile, keyfile = folder / "cert.pem", folder / "key.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(certfile))
    cert.private_key_pem.write_to_path(str(keyfile))
    port = free_port()
    options = ["--no-model", "--http2", "--http2-port", str(port)]
    options += ["--ssl-certfile", str(certfile), "--ssl-keyfile", str(keyfile)]
    with ServerProcess(*options) as server:
        server.wait_ready()
        yield H2Server(server, port, "https")


def token_texts(body: bytes) -> list[str]:
    return [json.loads(e.data)["text"] for e in Decoder().feed(body) if e.event == "token"]


def test_curl_with_prior_knowledge_streams_sse_over_h2_without_hop_by_hop_headers(
    h2c: H2Server,
) -> None:
    url = f"{h2c.url}/v1/demo/words?text=one%20two%20three&interval_ms=5"
    done = subprocess.run(
        ["curl", "-sS", "--http2-prior-knowledge", "-D", "-", "-N", url],
        capture_output=True,
        timeout=WAIT_S,
        check=True,
    )
    head, _, body = done.stdout.partition(b"\r\n\r\n")
    status, *lines = head.decode().split("\r\n")
    assert status.startswith("HTTP/2 200")
    names = {line.split(":", 1)[0].lower() for line in lines}
    assert not names & HOP_BY_HOP
    assert "text/event-stream; charset=utf-8" in head.decode()
    assert token_texts(body) == ["one", " two", " three"]


def test_httpx_over_h2c_creates_reads_and_uses_the_compatible_api(h2c: H2Server) -> None:
    with httpx.Client(base_url=h2c.url, http1=False, http2=True, timeout=WAIT_S) as client:
        created = client.post("/v1/streams", json={"prompt": "a b c", "model": "words"})
        assert created.http_version == "HTTP/2"
        assert created.status_code == 201
        events = client.get(created.json()["events_url"])
        assert events.http_version == "HTTP/2"
        assert token_texts(events.content) == ["a", " b", " c"]
        body = {
            "model": "words",
            "messages": [{"role": "user", "content": "x y"}],
            "stream": True,
        }
        chat = client.post("/v1/chat/completions", json=body)
        assert chat.http_version == "HTTP/2"
        chunks = [e.data for e in Decoder().feed(chat.content)]
        assert chunks[-1] == "[DONE]"
        text = "".join(
            json.loads(c)["choices"][0]["delta"].get("content") or ""
            for c in chunks[:-1]
            if json.loads(c)["choices"]
        )
        assert text == "x y"
        assert client.get("/healthz").http_version == "HTTP/2"


def test_tls_negotiates_h2_and_http11_by_alpn(tls: H2Server, ca: trustme.CA) -> None:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    url = "/v1/demo/words?text=p%20q&interval_ms=1"
    with httpx.Client(base_url=tls.url, http2=True, verify=context, timeout=WAIT_S) as client:
        response = client.get(url)
        assert response.http_version == "HTTP/2"
        assert token_texts(response.content) == ["p", " q"]
    with httpx.Client(base_url=tls.url, http2=False, verify=context, timeout=WAIT_S) as client:
        response = client.get(url)
        assert response.http_version == "HTTP/1.1"
        assert token_texts(response.content) == ["p", " q"]


def test_a_stalled_stream_does_not_stall_its_neighbour_on_the_same_connection(
    h2c: H2Server,
) -> None:
    """Stream 1 reads 2,000 unpaced tokens and never opens its window (its data is
    acknowledged on the connection only); stream 3, paced, still gets every event."""
    sock = socket.create_connection(("127.0.0.1", h2c.port), timeout=WAIT_S)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    sock.sendall(conn.data_to_send())
    authority = f"127.0.0.1:{h2c.port}"

    def get(stream_id: int, path: str) -> None:
        headers = [(":method", "GET"), (":scheme", "http"), (":authority", authority)]
        conn.send_headers(stream_id, [*headers, (":path", path)], end_stream=True)
        sock.sendall(conn.data_to_send())

    # 2,000 one-word tokens are about 120 KB of frames: well past the 64 KiB stream window.
    stalled = "w " * 2000
    text = "+".join(stalled.split())
    get(1, f"/v1/demo/words?text={text}&interval_ms=0&max_tokens=2000")
    get(3, "/v1/demo/words?text=alpha%20beta%20gamma%20delta&interval_ms=20")
    bodies: dict[int, bytearray] = {1: bytearray(), 3: bytearray()}
    ended: set[int] = set()
    try:
        while 3 not in ended:
            data = sock.recv(65536)
            assert data, "the server closed the connection"
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.DataReceived):
                    bodies[event.stream_id] += event.data
                    if event.stream_id == 1:  # the connection's window only
                        conn.increment_flow_control_window(event.flow_controlled_length)
                    else:
                        conn.acknowledge_received_data(
                            event.flow_controlled_length, event.stream_id
                        )
                elif isinstance(event, h2.events.StreamEnded):
                    ended.add(event.stream_id)
            sock.sendall(conn.data_to_send())
    finally:
        sock.close()
    assert token_texts(bytes(bodies[3])) == ["alpha", " beta", " gamma", " delta"]
    assert 1 not in ended  # still held by its closed window
    assert 0 < len(bodies[1]) <= 65535


def test_a_certificate_that_does_not_load_stops_the_start_with_a_clear_error(
    tmp_path: Path,
) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    command = [sys.executable, "-m", "sluice.cli", "serve", "--no-model", "--http2"]
    done = subprocess.run(
        [*command, "--ssl-certfile", str(junk), "--ssl-keyfile", str(junk)],
        capture_output=True,
        timeout=WAIT_S,
        check=False,
    )
    assert done.returncode == 2
    assert b"cannot use the TLS certificate and key" in done.stderr
    alone = subprocess.run(
        [*command[:-1], "--ssl-certfile", str(junk)], capture_output=True, timeout=WAIT_S
    )
    assert alone.returncode == 2
    assert b"--ssl-certfile and --ssl-keyfile are for --http2" in alone.stderr
