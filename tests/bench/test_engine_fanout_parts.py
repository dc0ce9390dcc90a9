"""The engine-shaped fan-out test's own parts: the one timer, our backend on it, the client's
token counter. (``test_quick.py`` runs the whole test against real servers.)"""

from __future__ import annotations

import asyncio
import importlib
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
# The benchmarks import each other as top-level modules, run from bench/.
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))
if str(BENCH_DIR / "ssebench") not in sys.path:
    sys.path.insert(0, str(BENCH_DIR / "ssebench"))

step_clock = importlib.import_module("step_clock")
engine_fanout = importlib.import_module("engine_fanout")
engine_server = importlib.import_module("engine_server")

from sluice.backends.base import GenerationRequest  # noqa: E402
from sluice.events import FinishReason  # noqa: E402

PERIOD_NS = 2_000_000  # 2 ms steps keep the tests short
WAIT_S = 10.0  # a bound on every wait below


class Recorder:
    """A stepped stream that records its steps' due times and stops after ``count``."""

    def __init__(self, count: int, finished: asyncio.Event | None = None) -> None:
        self.count = count
        self.dues: list[int] = []
        self.finished = finished or asyncio.Event()

    def step(self, due_ns: int) -> bool:
        self.dues.append(due_ns)
        if len(self.dues) == self.count:
            self.finished.set()
            return False
        return True


def test_step_clock_gives_every_joined_stream_one_token_per_step_on_the_same_schedule() -> None:
    async def run() -> list[Recorder]:
        clock = step_clock.StepClock(PERIOD_NS)
        streams = [Recorder(5) for _ in range(3)]
        for stream in streams:
            clock.join(stream)
        await asyncio.wait_for(asyncio.gather(*(s.finished.wait() for s in streams)), WAIT_S)
        assert clock.num_live == 0
        await clock.aclose()
        return streams

    first, *others = asyncio.run(run())
    assert len(first.dues) == 5
    assert all(other.dues == first.dues for other in others)  # one timer: the same steps
    assert [b - a for a, b in zip(first.dues, first.dues[1:], strict=False)] == [PERIOD_NS] * 4


def test_step_clock_stream_joined_later_starts_at_the_next_step_and_leave_stops_it() -> None:
    async def run() -> tuple[Recorder, Recorder]:
        clock = step_clock.StepClock(PERIOD_NS)
        early, late = Recorder(6), Recorder(2)
        clock.join(early)

        class Joiner:
            def step(self, due_ns: int) -> bool:
                clock.join(late)  # joins during step 1
                return False

        clock.join(Joiner())
        await asyncio.wait_for(late.finished.wait(), WAIT_S)
        clock.leave(early)
        steps_at_leave = len(early.dues)
        await clock.aclose()
        assert len(early.dues) == steps_at_leave  # nothing after leave
        return early, late

    early, late = asyncio.run(run())
    assert late.dues == early.dues[1:3]  # steps 2 and 3, the ones after it joined


def test_step_generation_yields_max_tokens_deltas_then_length() -> None:
    async def run() -> list[tuple[str, FinishReason | None]]:
        backend = engine_server.StepBackend("words", step_clock.StepClock(PERIOD_NS))
        generation = backend.generate(GenerationRequest(prompt="tick", max_tokens=4))
        await generation.start()
        out = []
        async with asyncio.timeout(WAIT_S):
            async for delta in generation:
                out += [(event.text, delta.finish_reason) for event in delta.events]
        assert generation.usage().completion_tokens == 4
        await backend.aclose()
        return out

    deltas = asyncio.run(run())
    assert [int(text.split()[1]) for text, _ in deltas] == [1, 2, 3, 4]
    assert [reason for _, reason in deltas] == [None, None, None, FinishReason.LENGTH]
    assert all(text.endswith(" ") for text, _ in deltas)  # coalesced runs stay countable


def test_step_generation_aborted_mid_stream_ends_and_leaves_the_clock() -> None:
    async def run() -> int:
        clock = step_clock.StepClock(PERIOD_NS)
        generation = engine_server.StepBackend("words", clock).generate(
            GenerationRequest(prompt="tick")
        )
        seen = 0
        async with asyncio.timeout(WAIT_S):
            async for _ in generation:
                seen += 1
                if seen == 2:
                    await generation.abort()
        assert clock.num_live == 0
        await clock.aclose()
        return seen

    assert asyncio.run(run()) == 2


# ---------------------------------------------------------------- the client's counter


def _ssebench() -> ModuleType:
    return importlib.import_module("ssebench")


HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _ours(texts: list[str]) -> bytes:
    """Our frames: an id, ``event: token`` and JSON data per event."""
    return b"".join(
        f'id: s-{i}\nevent: token\ndata: {{"text":"{text}"}}\n\n'.encode()
        for i, text in enumerate(texts)
    )


def _tokens(seqs: list[int]) -> list[str]:
    return [f"{1000 + seq} {seq} {900 + seq} " for seq in seqs]


def _feed(body: bytes, num_tokens: int, one_byte_at_a_time: bool) -> Any:
    async def run() -> Any:
        sb = _ssebench()
        cls = engine_fanout.token_stream_class(sb)
        stream = cls(0, lat=[], klat=[], dlat=[], late=[], num_tokens=num_tokens)
        data = HEAD + _chunk(body) + b"0\r\n\r\n"
        pieces = [data[i : i + 1] for i in range(len(data))] if one_byte_at_a_time else [data]
        for piece in pieces:
            stream.data_received(piece)
        return stream

    return asyncio.run(run())


@pytest.mark.parametrize("one_byte_at_a_time", [False, True])
def test_token_counter_counts_every_token_of_coalesced_events_and_skips_others(
    one_byte_at_a_time: bool,
) -> None:
    texts = [*_tokens([1, 2]), "".join(_tokens([3, 4, 5])), *_tokens([6])]  # 3-5 coalesced
    body = b'event: start\ndata: {"model":"words"}\n\n' + _ours(texts)
    body += b': ping\n\nevent: done\ndata: {"finish_reason":"length"}\n\n'
    stream = _feed(body, 6, one_byte_at_a_time)
    assert stream.tokens_missing() == 0
    assert stream.duplicated == 0
    assert stream.next_seq == 7


def test_token_counter_reads_sse_starlette_crlf_frames() -> None:
    body = b"".join(f"data: {text}\r\n\r\n".encode() for text in _tokens([1, 2, 3]))
    stream = _feed(body, 3, one_byte_at_a_time=True)
    assert stream.tokens_missing() == 0


def test_token_counter_reports_a_gap_a_duplicate_and_a_short_tail() -> None:
    stream = _feed(_ours(_tokens([1, 2, 4, 4, 5])), 7, one_byte_at_a_time=False)
    assert stream.duplicated == 1
    assert stream.tokens_missing() == 3  # 3, then 6 and 7
