"""The resuming transport's sans-IO cursor: which bytes pass on (whole frames, comments at
once), when a stream is over, and what it asks to resume. Every reader is tested whole,
one byte at a time and with a trailing cut frame."""

from __future__ import annotations

import httpx2
import pytest

from sluice.client import MAX_FRAME_BYTES, ResumeCursor, ResumeError, ResumeSettings
from sluice.errors import ConfigError

FRAMES = (
    b'id: s1:1\nevent: start\ndata: {"model": "m"}\n\n'
    b": ping\n"
    b'id: s1:2\r\nevent: token\r\ndata: {"text": "a"}\r\n\r\n'
    b'id: s1:3\revent: token\rdata: {"text": "b"}\r\r'
)
CUT = b'id: s1:4\nevent: token\ndata: {"te'


def cursor(
    url: str = "http://127.0.0.1:9/v1/chat/completions",
    request_headers: dict[str, str] | None = None,
    response_headers: dict[str, str] | None = None,
    settings: ResumeSettings | None = None,
) -> ResumeCursor:
    request = httpx2.Request("POST", url, headers=request_headers or {})
    headers = {"content-type": "text/event-stream", "x-sluice-stream-id": "s1"}
    response = httpx2.Response(200, headers={**headers, **(response_headers or {})})
    return ResumeCursor(request, response, settings or ResumeSettings())


def feed_in(pieces: list[bytes]) -> tuple[bytes, ResumeCursor]:
    resume = cursor()
    return b"".join(resume.feed(piece) for piece in pieces), resume


@pytest.mark.parametrize(
    "split",
    [
        lambda data: [data],
        lambda data: [data[i : i + 1] for i in range(len(data))],
        lambda data: [data[i : i + 5] for i in range(0, len(data), 5)],
    ],
    ids=["whole", "byte-at-a-time", "five-bytes"],
)
def test_whole_frames_pass_and_a_cut_one_is_held_however_the_bytes_are_split(split) -> None:  # type: ignore[no-untyped-def]
    passed, resume = feed_in(split(FRAMES + CUT))
    assert passed == FRAMES
    assert resume.last_event_id == "s1:3"
    assert not resume.finished


def test_a_comment_at_a_frame_start_passes_at_once_and_one_inside_a_frame_waits() -> None:
    resume = cursor()
    assert resume.feed(b": ping\n") == b": ping\n"
    assert resume.feed(b"data: x\n: inside\n") == b""
    assert resume.feed(b"\n") == b"data: x\n: inside\n\n"


def test_a_cr_at_the_end_waits_for_the_next_byte_so_a_split_crlf_is_one_line_end() -> None:
    resume = cursor()
    assert resume.feed(b"data: x\r") == b""
    assert resume.feed(b"\n") == b""  # CRLF: one line end, not a blank line
    assert resume.feed(b"\r\n") == b"data: x\r\n\r\n"


@pytest.mark.parametrize(
    ("frame", "terminal"),
    [
        (b'event: done\ndata: {"reason": "stop"}\n\n', True),
        (b"event: error\ndata: {}\n\n", True),
        (b"event: message_stop\ndata: {}\n\n", True),
        (b"event: response.completed\ndata: {}\n\n", True),
        (b"data: [DONE]\n\n", True),
        (b'event: token\ndata: {"text": "done"}\n\n', False),
        (b'data: {"choices": []}\n\n', False),
    ],
)
def test_a_terminal_frame_finishes_the_stream(frame: bytes, terminal: bool) -> None:
    resume = cursor()
    resume.feed(frame)
    assert resume.finished is terminal
    assert (resume.next_request() is None) is terminal


def test_a_compatible_stream_resumes_at_its_events_url_with_token_credentials_and_last_id() -> None:
    resume = cursor(
        "http://127.0.0.1:9/api/v1/chat/completions?x=1",
        request_headers={"Authorization": "Bearer k", "X-Sluice-Resumable": "true"},
        response_headers={"X-Sluice-Resume-Token": "1.mac"},
    )
    resume.feed(FRAMES + CUT)
    request = resume.next_request()
    assert request is not None
    assert request.method == "GET"
    assert str(request.url) == "http://127.0.0.1:9/api/v1/streams/s1/events"
    assert request.headers["last-event-id"] == "s1:3"
    assert request.headers["authorization"] == "Bearer k"
    assert request.headers["x-sluice-resume-token"] == "1.mac"
    assert "x-sluice-resumable" not in request.headers


def test_a_native_read_resumes_its_own_url_token_included() -> None:
    resume = cursor("http://127.0.0.1:9/v1/streams/s1/events?token=1.mac")
    assert resume.feed(b"id: s1:1\ndata: x\n\n") == b"id: s1:1\ndata: x\n\n"
    request = resume.next_request()
    assert request is not None
    assert str(request.url) == "http://127.0.0.1:9/v1/streams/s1/events?token=1.mac"


def test_a_frame_cut_by_a_drop_passes_once_whole_from_the_resumed_body() -> None:
    resume = cursor()
    assert resume.feed(FRAMES + CUT) == FRAMES
    assert resume.next_request() is not None
    rest = CUT + b'xt": "c"}\n\n'
    assert resume.feed(rest) == rest  # the cut bytes were dropped, not joined to these
    assert resume.last_event_id == "s1:4"


def test_which_responses_take_part() -> None:
    def applies(url: str, request_headers: dict[str, str], status: int = 200) -> bool:
        request = httpx2.Request("POST", url, headers=request_headers)
        response = httpx2.Response(
            status, headers={"content-type": "text/event-stream", "x-sluice-stream-id": "s1"}
        )
        return ResumeCursor.applies(request, response)

    chat = "http://h/v1/chat/completions"
    assert applies(chat, {"X-Sluice-Resumable": "true"})
    assert not applies(chat, {})  # not resumable: nothing to resume
    assert not applies(chat, {"X-Sluice-Resumable": "true"}, status=429)
    assert applies("http://h/v1/streams/s1/events", {})
    plain = httpx2.Response(200, headers={"content-type": "application/json"})
    assert not ResumeCursor.applies(httpx2.Request("GET", "http://h/v1/streams/s1/events"), plain)


def test_answers_to_a_resume() -> None:
    resume = cursor()
    assert resume.next_request() is not None
    assert resume.answered(httpx2.Response(200))
    assert not resume.answered(httpx2.Response(503, headers={"Retry-After": "2"}))
    assert resume.next_request() is not None
    assert resume.delay_s == 2.0  # the server's Retry-After, not the doubled delay
    with pytest.raises(ResumeError, match="410"):
        resume.answered(httpx2.Response(410))
    assert not resume.answered(httpx2.Response(204))
    assert resume.finished
    assert resume.next_request() is None


def test_delays_start_at_the_servers_retry_and_double_until_a_frame_arrives() -> None:
    resume = cursor(settings=ResumeSettings(max_attempts=3, initial_delay_s=0.1, max_delay_s=1))
    resume.feed(b"retry: 300\n\n")
    delays = []
    for _ in range(3):
        assert resume.next_request() is not None
        delays.append(resume.delay_s)
    assert delays == [0.3, 0.6, 1.0]
    with pytest.raises(ResumeError, match="3 attempts"):
        resume.next_request()


def test_a_frame_resets_the_attempts() -> None:
    resume = cursor(settings=ResumeSettings(max_attempts=1))
    for _ in range(5):
        assert resume.next_request() is not None
        resume.feed(b"data: x\n\n")


def test_a_frame_past_the_bound_is_refused() -> None:
    with pytest.raises(ResumeError, match="bytes"):
        cursor().feed(b"data: " + b"x" * MAX_FRAME_BYTES)


@pytest.mark.parametrize(
    "options",
    [{"max_attempts": 0}, {"initial_delay_s": -1}, {"initial_delay_s": 9, "max_delay_s": 1}],
)
def test_bad_settings_are_refused(options: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        ResumeSettings(**options)  # type: ignore[arg-type]
