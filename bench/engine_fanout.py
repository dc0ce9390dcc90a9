"""The engine-shaped fan-out measurement of ``sse_fanout.py`` (``--only engine``): client side.

N streams of K tokens each, every token produced by ONE timer on the server that gives
each live stream its next token every 20 ms (``step_clock.py``; ours:
``engine_server.py``, the baseline: ``engine_peer.py``). Every token's data is
``"<emit_ns> <seq> <due_ns> "`` (ours wraps it as ``{"text":"..."}``; an event may carry
several tokens when ours coalesces a lagging reader's run). The client is ssebench's
(raw asyncio protocols, kernel RX timestamps through ``SO_TIMESTAMPNS``) with its SSE
parser replaced by :class:`TokenStream`, which reads every token of every event and

- counts the tokens of each stream: a token whose ``seq`` is not the next one is a
  duplicate (it came before) or marks a gap (the ones it skipped are missing); a stream
  that ends, or is still open at the deadline, before its K-th token misses the rest;
- while the measurement window is open, records step-to-client latency (the step's due
  time -> the kernel RX timestamp of the read that carried the token), the write path
  (``emit_ns`` -> kernel RX) and the step's lateness (``emit_ns`` - due).

Timeline: open N streams (100 handshakes at a time), ``warmup_s``, the window
(``duration_s``), then wait (at most ``drain_s``) for every stream to end. K covers the
ramp allowance, the warm-up and the window at 50 tokens/s, so every stream is live
through the window when the ramp takes at most ``ramp_allowance_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Iterator
from types import ModuleType
from typing import Any

__all__ = ["run_engine", "tokens_per_stream"]

RATE_PER_S = 50.0  # one step per 20 ms (step_clock.STEP_PERIOD_NS)
_JSON_HEAD = b'{"text":"'
_JSON_TAIL = b'"}'


def tokens_per_stream(ramp_allowance_s: float, warmup_s: float, duration_s: float) -> int:
    """K: tokens enough for every stream to stay live through the window."""
    return math.ceil(RATE_PER_S * (ramp_allowance_s + warmup_s + duration_s))


def token_stream_class(ssebench: ModuleType) -> type:
    """ssebench's ``SSEStream`` with a parser that counts and times every token."""
    base = ssebench.SSEStream
    window = ssebench.Window

    class TokenStream(base):
        __slots__ = ("duplicated", "line_tail", "missing", "next_seq", "num_tokens")

        def __init__(self, *args: Any, num_tokens: int = 0, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.line_tail = b""
            self.num_tokens = num_tokens
            self.next_seq = 1
            self.missing = 0
            self.duplicated = 0

        def _sse(self, payload: bytes, now: int) -> None:
            # Whole lines only: a line cut by a read waits for the read that completes it.
            if self.line_tail:
                payload = self.line_tail + payload
            cut = payload.rfind(b"\n") + 1
            self.line_tail = payload[cut:]
            if not cut:
                return
            payload = payload[:cut]
            if b"\r" in payload:  # sse-starlette ends lines with CRLF
                payload = payload.replace(b"\r\n", b"\n")
            buf = self.sbuf + payload if self.sbuf else payload
            if b"\n\n" not in buf:
                self.sbuf = buf
                return
            blocks = buf.split(b"\n\n")
            self.sbuf = blocks.pop()
            recording = window.on
            arrival = self.krx or now
            krx = self.krx
            num_events = 0
            for block in blocks:
                if block[:5] == b"data:":
                    value = block[5:]
                else:
                    i = block.find(b"\ndata:")
                    if i < 0:
                        continue  # a comment (ping) or a retry hint
                    value = block[i + 6 :]
                num_events += 1
                value = value.strip()
                if value[:9] == _JSON_HEAD:
                    if value[-2:] != _JSON_TAIL:
                        continue  # not a token: ours' start/usage/done
                    value = value[9:-2]
                fields = value.split()
                if not fields or len(fields) % 3 or not fields[0].isdigit():
                    continue
                for k in range(0, len(fields), 3):
                    emit, seq, due = int(fields[k]), int(fields[k + 1]), int(fields[k + 2])
                    self._count(seq)
                    if recording:
                        self.dlat.append(arrival - due)
                        self.late.append(emit - due)
                        if krx:
                            self.klat.append(krx - emit)
                        self.wevents += 1
            if num_events:
                if not self.t_first:
                    self.t_first = now
                self.t_last = now
                self.events += num_events

        def _count(self, seq: int) -> None:
            expected = self.next_seq
            if seq == expected:
                self.next_seq = seq + 1
            elif seq < expected:
                self.duplicated += 1
            else:
                self.missing += seq - expected
                self.next_seq = seq + 1

        def tokens_missing(self) -> int:
            """Gaps so far plus the tokens not (yet) received after the last one."""
            return self.missing + max(0, self.num_tokens - (self.next_seq - 1))

    return TokenStream


@contextlib.contextmanager
def _stream_class(ssebench: ModuleType, cls: type) -> Iterator[None]:
    """Make ssebench's ``open_stream`` build ``cls`` (it reads the module-level name)."""
    saved = ssebench.SSEStream
    ssebench.SSEStream = cls
    try:
        yield
    finally:
        ssebench.SSEStream = saved


async def run_engine(
    ssebench: ModuleType,
    url: str,
    streams_n: int,
    num_tokens: int,
    warmup_s: float,
    duration_s: float,
    drain_s: float,
    pid: int | None,
) -> dict[str, Any]:
    """Run one engine-shaped fan-out against ``url``; ssebench-style result row."""
    sb = ssebench
    host, port, path, _ = sb.parse_url(url)
    ts_offset = sb.realtime_minus_monotonic()
    probe = sb.ServerProbe(pid)
    client_cpu = sb.ClientCPU()
    lat: list[int] = []
    klat: list[int] = []
    dlat: list[int] = []
    late: list[int] = []
    sb.Window.on = False
    request = sb.build_request(host, port, path)
    with _stream_class(sb, token_stream_class(sb)):
        streams, ramp_s = await sb.open_many(
            host,
            port,
            request,
            streams_n,
            100,
            10.0,
            ts_offset=ts_offset,
            lat=lat,
            klat=klat,
            dlat=dlat,
            late=late,
            num_tokens=num_tokens,
        )
    try:
        await asyncio.sleep(warmup_s)
        probe.refresh()
        cpu0 = probe.fine_cpu()
        t0 = time.monotonic()
        sb.Window.on = True
        await asyncio.sleep(duration_s)
        sb.Window.on = False
        wall = time.monotonic() - t0
        cpu1 = probe.fine_cpu()
        client_util = client_cpu.util()
        pending = [s.done_fut for s in streams if s.ok and not s.done_fut.done()]
        drain_t0 = time.monotonic()
        if pending:
            await asyncio.wait(pending, timeout=drain_s)
        drain_wait_s = time.monotonic() - drain_t0
    finally:
        sb.Window.on = False
        sb.close_all(streams)
    ok = [s for s in streams if s.ok]  # the others are counted under errors
    dlat.sort()
    klat.sort()
    late.sort()
    pct = sb.pct

    def us(v: float | None) -> float | None:
        return None if v is None else round(v / 1e3, 1)

    produced = len(ok) * num_tokens
    missing = sum(s.tokens_missing() for s in ok)
    return {
        "test": "engine",
        "url": url,
        "streams": streams_n,
        "ok_streams": len(ok),
        "tokens_per_stream": num_tokens,
        "ramp_s": round(ramp_s, 2),
        "duration_s": round(wall, 3),
        "window_tokens": len(dlat),
        "window_tokens_per_s": round(len(dlat) / wall, 1) if wall else None,
        "window_delivery_ratio": (
            round(len(dlat) / (len(ok) * RATE_PER_S * wall), 4) if ok and wall else None
        ),
        "tokens_produced": produced,
        "tokens_delivered": produced - missing,
        "tokens_missing": missing,
        "tokens_duplicated": sum(s.duplicated for s in ok),
        "streams_incomplete": sum(1 for s in ok if s.tokens_missing()),
        "drain_wait_s": round(drain_wait_s, 2),
        "e2e_p50_us": us(pct(dlat, 50)),
        "e2e_p99_us": us(pct(dlat, 99)),
        "e2e_p999_us": us(pct(dlat, 99.9)),
        "e2e_max_us": us(dlat[-1] if dlat else None),
        "krx_p50_us": us(pct(klat, 50)),
        "krx_p99_us": us(pct(klat, 99)),
        "late_p50_us": us(pct(late, 50)),
        "late_p99_us": us(pct(late, 99)),
        "errors": sb._err_summary(streams),
        "server_pids": probe.pids,
        "server_cpu_pct": round(100 * (cpu1 - cpu0) / wall, 1) if cpu0 is not None else None,
        "client_cpu_util": round(client_util, 3),
    }
