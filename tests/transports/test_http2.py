"""HTTP/2 beside HTTP/1.1 (``sluice serve --http2``) with real clients: curl with prior
knowledge, httpx over h2c and over TLS (ALPN), and a raw ``h2`` connection whose one
stalled stream must not stall the other."""

from __future__ import annotations

import json
import signal
import socket
import ssl
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import httpx
import pytest
import trustme

from sluice.sse import Decoder, Event
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


class RawH2:
    """A client of our own over ``h2``: what httpx does not let a test do (reset a stream,
    see the GOAWAY), with every stream's body and end kept."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.conn.initiate_connection()
        self.sock.sendall(self.conn.data_to_send())
        self.bodies: dict[int, bytearray] = {}
        self.statuses: dict[int, bytes] = {}
        self.ended: set[int] = set()
        self.reset: set[int] = set()
        self.goaway: h2.events.ConnectionTerminated | None = None

    def get(self, path: str) -> int:
        stream_id = self.conn.get_next_available_stream_id()
        headers = [(":method", "GET"), (":scheme", "http"), (":path", path)]
        headers.append((":authority", f"127.0.0.1:{self.port}"))
        self.conn.send_headers(stream_id, headers, end_stream=True)
        self.sock.sendall(self.conn.data_to_send())
        self.bodies[stream_id] = bytearray()
        return stream_id

    def cancel(self, stream_id: int) -> None:
        self.conn.reset_stream(stream_id)
        self.sock.sendall(self.conn.data_to_send())

    def read_until(self, done: Callable[[], bool]) -> None:
        while not done():
            data = self.sock.recv(65536)
            if not data:
                return
            for event in self.conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    self.statuses[event.stream_id] = dict(event.headers)[b":status"]
                elif isinstance(event, h2.events.DataReceived):
                    self.bodies.setdefault(event.stream_id, bytearray()).extend(event.data)
                    self.conn.acknowledge_received_data(
                        event.flow_controlled_length, event.stream_id
                    )
                elif isinstance(event, h2.events.StreamEnded):
                    self.ended.add(event.stream_id)
                elif isinstance(event, h2.events.StreamReset):
                    self.reset.add(event.stream_id)
                elif isinstance(event, h2.events.ConnectionTerminated):
                    self.goaway = event
            self.sock.sendall(self.conn.data_to_send())

    def events(self, stream_id: int) -> list[Event]:
        return Decoder().feed(bytes(self.bodies[stream_id]))

    def close(self) -> None:
        self.sock.close()


def test_a_stream_the_client_resets_leaves_its_connection_serving(h2c: H2Server) -> None:
    client = RawH2(h2c.port)
    try:
        long = client.get("/v1/demo/words?text=" + "+".join(["w"] * 500) + "&interval_ms=20")
        client.read_until(lambda: b"event: token" in client.bodies[long])
        client.cancel(long)
        short = client.get("/v1/demo/words?text=after%20the%20reset&interval_ms=1")
        client.read_until(lambda: short in client.ended)
    finally:
        client.close()
    assert token_texts(bytes(client.bodies[short])) == ["after", " the", " reset"]
    assert long not in client.ended


def test_http11_on_the_h2c_port_is_the_native_path_with_its_limits(h2c: H2Server) -> None:
    with httpx.Client(base_url=h2c.url, http2=False, timeout=WAIT_S) as client:
        response = client.get("/v1/demo/words?text=plain%20h1&interval_ms=1")
        assert response.http_version == "HTTP/1.1"
        assert token_texts(response.content) == ["plain", " h1"]
        too_long = client.get("/healthz?" + "x" * 9000)
        assert too_long.status_code == 414


def test_limits_over_h2_are_the_http11_ports_and_cost_one_stream(h2c: H2Server) -> None:
    with httpx.Client(base_url=h2c.url, http1=False, http2=True, timeout=WAIT_S) as client:
        too_long = client.get("/v1/demo/words?text=" + "x" * 9000)
        assert too_long.http_version == "HTTP/2"
        assert too_long.status_code == 414
        assert too_long.json()["error"]["code"] == "url_too_long"
        body = {"model": "words", "messages": [{"role": "user", "content": "y" * 1_100_000}]}
        too_big = client.post("/v1/chat/completions", json=body)
        assert too_big.status_code == 413
        # The same connection serves on.
        assert client.get("/healthz").status_code == 200


def test_sigterm_ends_h2_streams_on_an_event_boundary_then_goaway() -> None:
    """Drain over h2: the live stream gets one retryable error and a clean END_STREAM (not
    a reset), the connection a GOAWAY, and the process exits 0."""
    port = free_port()
    with ServerProcess("--no-model", "--http2-port", str(port), "--drain-timeout", "1") as server:
        server.wait_ready()
        client = RawH2(port)
        try:
            stream = client.get("/v1/demo/words?text=" + "+".join(["d"] * 400) + "&interval_ms=50")
            client.read_until(lambda: b"event: token" in client.bodies[stream])
            assert server.process is not None
            server.process.send_signal(signal.SIGTERM)
            client.read_until(lambda: stream in client.ended and client.goaway is not None)
        finally:
            client.close()
        events = client.events(stream)
        terminal = [e for e in events if e.event in ("done", "error")]
        assert [e.event for e in terminal] == ["error"]
        assert events[-1] is terminal[0]
        assert json.loads(terminal[0].data)["code"] == "unavailable"
        assert client.goaway is not None
        assert client.goaway.error_code == 0
        assert server.process.wait(timeout=WAIT_S) == 0


def test_without_the_native_path_h2_streams_through_the_asgi_app() -> None:
    """``--no-native-sse``: the same reads and APIs over h2, through ``receive``/``send``."""
    port = free_port()
    with ServerProcess("--no-model", "--http2-port", str(port), "--no-native-sse") as server:
        server.wait_ready()
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=base, http1=False, http2=True, timeout=WAIT_S) as client:
            response = client.get("/v1/demo/words?text=through%20asgi&interval_ms=1")
            assert response.http_version == "HTTP/2"
            assert token_texts(response.content) == ["through", " asgi"]
            body = {"model": "words", "messages": [{"role": "user", "content": "a b"}]}
            chat = client.post("/v1/chat/completions", json={**body, "stream": False})
            assert chat.status_code == 200
            assert chat.json()["choices"][0]["message"]["content"] == "a b"
