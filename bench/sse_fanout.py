"""SSE fan-out benchmark: our SSE path against the sse-starlette baseline, one run, one client.

What it measures. Every server is a fresh child process on 127.0.0.1; both are read by the
same load generator, the shared ssebench harness (the copy in ``bench/ssebench/``, or
``--ssebench-dir``), with the same parameters:

1. throughput: K clients each read a burst of M events of ~20 B as fast as the server
   makes them. Ours: ``sluice serve``; each client creates its stream with
   ``POST /v1/streams {"prompt": "<M words>", "model": "words", "interval_ms": 0}`` and
   reads the ``events_url`` it is given, on the same keep-alive connection, as a real
   client does (one ``token`` event per word plus ``start``/``usage``/``done``: M + 3
   counted events; the POST is inside the measured window, so ours pays for one more
   request per stream than the baseline); baseline: ``/burst?n=M&size=20``. Headline:
   server CPU seconds per 1M events. (A 1,000-word ``/v1/demo/words?text=`` URL is over
   the server's 8 KiB request-target limit: 414.)
2. concurrency: a stepped ramp of slow streams (one event per second each), held a few
   seconds at each level, against a freshly started server. Ours:
   ``/v1/demo/words?text=<--idle-words words>&interval_ms=1000``; baseline:
   ``/slow?interval=1``. Headline: server RSS growth per held stream at the top level.
3. latency: C streams x 50 timestamped events/s. Ours: ``bench/tick_server.py``, which is
   ``sluice serve`` with a bench-only backend whose tokens are ``"<emit_ns> <seq> <due_ns>"``
   (the real hub, log, encoding and SSE writer); baseline: ``/tick?rate=50``. Headline:
   end-to-end p99 (due time -> kernel RX timestamp of the read that carried the event).
4. engine: N streams of K tokens that arrive the way an engine makes them: ONE timer
   gives every live stream its next token each 20 ms (``step_clock.py``). Ours:
   ``bench/engine_server.py`` (``sluice serve`` with a backend whose generations are fed
   by that timer), ``/v1/demo/words?text=tick&max_tokens=K``; baseline:
   ``bench/engine_peer.py`` (sse-starlette, the same timer filling each stream's queue),
   ``/engine?count=K``. Every token of every stream is counted (missing or duplicated
   ones are problems). Headline: step-to-client p99 (the step's due time -> kernel RX).

The issue's targets for our server are checked in the same run and printed as PASS/MISS
next to the baseline's value and the ratio ours / baseline. A markdown table goes to
stdout, progress to stderr.

Run from the repository root (a full run takes about 10 minutes on 2 vCPUs; ``--quick`` is
a ~30 s smoke run):

    .venv/bin/python bench/sse_fanout.py
    .venv/bin/python bench/sse_fanout.py --quick
    .venv/bin/python bench/sse_fanout.py --only throughput,latency --reps 5 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import importlib.metadata
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import quote_plus

from created_stream import run_created_throughput
from engine_fanout import run_engine, tokens_per_stream
from peers import (
    BENCH_DIR,
    ServerProcess,
    baseline_command,
    engine_baseline_command,
    engine_command,
    free_port,
    ours_command,
    scan_log,
)
from peers import tick_command as tick_server_command

REPO = BENCH_DIR.parent
PEERS = ("ours", "baseline")
LABELS = {"ours": "sluice", "baseline": "sse-starlette"}
TESTS = ("throughput", "concurrency", "latency", "engine")
# The targets for our server: the headline key of each test and its upper bound.
TARGETS = {
    "throughput": ("server_sched_cpu_s_per_1m_events", 2.2),
    "concurrency": ("rss_per_conn_kb", 12.0),
    "latency": ("e2e_p99_us", 2000.0),
    "engine": ("e2e_p99_us", 5000.0),
}
# sse-starlette's value in ssebench's RESULTS.md (the machine the targets were set against),
# to restate the targets as ratios that do not depend on this machine's speed.
RESULTS_MD_BASELINE = {"throughput": 10.8, "concurrency": 42.7}

Row = dict[str, Any]
Runs = dict[str, dict[str, list[Any]]]


@dataclass
class Config:
    reps: int = 3
    tp_clients: int = 100
    tp_events: int = 1000
    tp_size: int = 20
    levels: tuple[int, ...] = (1000, 5000, 10000)
    hold_s: float = 3.0
    # One word per second: the streams must outlive the whole stepped ramp (30-110 s on a
    # busy 2-vCPU machine).
    idle_words: int = 150
    lat_streams: int = 1000
    lat_rate: float = 50.0
    lat_duration_s: float = 3.0
    lat_warmup_s: float = 1.0
    # Engine-shaped: N streams fed by one 20 ms timer; K tokens each cover the ramp
    # allowance, the warm-up and the window (engine_fanout.tokens_per_stream).
    eng_streams: int = 1000
    eng_ramp_allowance_s: float = 5.0
    eng_warmup_s: float = 1.0
    eng_duration_s: float = 3.0
    eng_drain_s: float = 30.0

    @classmethod
    def quick(cls) -> Config:
        return cls(
            reps=1,
            tp_clients=20,
            tp_events=200,
            levels=(500,),
            hold_s=2.0,
            idle_words=60,
            lat_streams=100,
            lat_duration_s=1.0,
            lat_warmup_s=0.5,
            eng_streams=100,
            eng_ramp_allowance_s=2.0,
            eng_warmup_s=0.5,
            eng_duration_s=2.0,
            eng_drain_s=15.0,
        )

    @property
    def eng_tokens(self) -> int:
        return tokens_per_stream(self.eng_ramp_allowance_s, self.eng_warmup_s, self.eng_duration_s)


# ---------------------------------------------------------------- the shared client


def load_ssebench(directory: Path) -> ModuleType:
    """Import ``ssebench.py`` from ``directory`` and install the JSON-aware stream class."""
    if not (directory / "ssebench.py").is_file() or not (directory / "peers").is_dir():
        raise SystemExit(
            f"sse_fanout: no ssebench in {directory} (want ssebench.py and peers/asgi_apps.py "
            "there); pass --ssebench-dir DIR"
        )
    sys.path.insert(0, str(directory))
    module = importlib.import_module("ssebench")
    install_json_text_client(module)
    return module


def install_json_text_client(ssebench: ModuleType) -> None:
    """Make ssebench's client read timestamps from ``{"text":"..."}`` data as well.

    Our token events carry JSON (``data: {"text":"<emit> <seq> <due>"}``); the baseline
    sends the bare ``<emit> <seq> <due>``. This subclass rewrites the JSON wrapper away
    before ssebench's own parser reads the blocks, and hands on complete lines only (a line
    cut by a read waits for the next read, the one that completes its event anyway). Bare
    data passes unchanged, so both servers are read by the same code; streams that only
    count events (throughput, concurrency) go straight to ssebench's parser.
    """
    base = ssebench.SSEStream

    class JSONTextStream(base):
        __slots__ = ("line_tail",)

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.line_tail = b""

        def _sse(self, payload: bytes, now: int) -> None:
            if self.lat is None:
                super()._sse(payload, now)
                return
            if self.line_tail:
                payload = self.line_tail + payload
            cut = payload.rfind(b"\n") + 1
            self.line_tail = payload[cut:]
            if not cut:
                return
            payload = payload[:cut]
            if b'data: {"text":"' in payload:
                payload = payload.replace(b'data: {"text":"', b"data: ").replace(b'"}\n', b"\n")
            super()._sse(payload, now)

    # open_stream() builds its protocol objects from this module-level name.
    ssebench.SSEStream = JSONTextStream


def measure(coro: Any) -> Any:
    """Run one measurement on a fresh event loop (uvloop when installed), as ssebench does."""
    uvloop = sys.modules["ssebench"].uvloop
    result = uvloop.run(coro) if uvloop else asyncio.run(coro)
    gc.collect()
    return result


# ---------------------------------------------------------------- servers and measurements


class Bench:
    """Starts a fresh server for each measurement and runs ssebench against it."""

    def __init__(
        self, ssebench: ModuleType, ssebench_dir: Path, cfg: Config, log_dir: Path, source: Path
    ):
        self.sb = ssebench
        self.sb_dir = ssebench_dir
        self.cfg = cfg
        self.log_dir = log_dir
        self.env = {"PYTHONPATH": str(source)}  # our servers run the snapshot of src/
        self.servers: list[ServerProcess] = []
        self.server_nofile: dict[str, str] = {}

    def server(self, peer: str, test: str) -> ServerProcess:
        port = free_port()
        if peer == "baseline" and test == "engine":
            command, health = engine_baseline_command(port), "/"
        elif peer == "baseline":
            command, health = baseline_command(self.sb_dir, port), "/"
        elif test == "engine":
            command, health = engine_command(port, "--retention", "5"), "/healthz"
        elif test == "latency":
            # Tick streams run until their reader has been gone for the grace window; keep
            # that short, and finished logs few, so repetitions do not load each other.
            command = tick_server_command(port, "--grace", "0.5", "--retention", "5")
            health = "/healthz"
        else:
            command, health = ours_command(port, "--retention", "5"), "/healthz"
        srv = ServerProcess(
            f"{peer}-{test}", command, port, health, self.log_dir / f"{peer}.log", self.env
        )
        self.servers.append(srv)
        return srv

    def url(self, peer: str, test: str, port: int) -> str:
        cfg, base = self.cfg, f"http://127.0.0.1:{port}"
        if peer == "baseline":
            path = {
                "throughput": f"/burst?n={cfg.tp_events}&size={cfg.tp_size}",
                "concurrency": "/slow?interval=1",
                "latency": f"/tick?rate={cfg.lat_rate:g}",
                "engine": f"/engine?count={cfg.eng_tokens}",
            }[test]
        elif test == "engine":
            path = f"/v1/demo/words?text=tick&max_tokens={cfg.eng_tokens}"
        elif test == "throughput":
            path = ""  # each client POSTs to /v1/streams: see throughput()
        elif test == "concurrency":
            path = f"/v1/demo/words?text={quote_plus(idle_text(cfg.idle_words))}&interval_ms=1000"
        else:
            path = f"/v1/demo/words?text=tick&interval_ms={1000 / cfg.lat_rate:g}"
        return base + path

    def run(self, peer: str, test: str) -> Any:
        measurement: Callable[[str, str, int], Any] = getattr(self, test)
        with self.server(peer, test) as srv:
            self.server_nofile.setdefault(peer, srv.nofile_limit())
            return measurement(peer, self.url(peer, test, srv.port), srv.pid)

    def throughput(self, peer: str, url: str, pid: int) -> Row:
        cfg = self.cfg
        if peer == "baseline":
            measure(self.sb.run_throughput(url, 10, pid=None))  # warm-up burst, discarded
            time.sleep(0.3)
            return measure(self.sb.run_throughput(url, cfg.tp_clients, timeout=60.0, pid=pid))
        # The words of a burst do not fit in a request target (8 KiB): each client creates
        # its stream with POST /v1/streams and reads the events_url it gets back.
        words = " ".join(f"w{i:0{cfg.tp_size - 1}d}" for i in range(cfg.tp_events))
        body = json.dumps({"prompt": words, "model": "words", "interval_ms": 0}).encode()
        measure(run_created_throughput(self.sb, url, body, 10))  # warm-up burst, discarded
        time.sleep(0.3)
        return measure(run_created_throughput(self.sb, url, body, cfg.tp_clients, 60.0, pid))

    def concurrency(self, peer: str, url: str, pid: int) -> list[Row]:
        cfg = self.cfg
        ramp = self.sb.run_concurrency(
            url, list(cfg.levels), cfg.hold_s, interval=1.0, pid=pid, ramp_timeout=120.0
        )
        return measure(ramp)

    def latency(self, peer: str, url: str, pid: int) -> Row:
        cfg = self.cfg
        ticks = self.sb.run_latency(
            url, cfg.lat_streams, cfg.lat_duration_s, cfg.lat_warmup_s, rate=cfg.lat_rate, pid=pid
        )
        return measure(ticks)

    def engine(self, peer: str, url: str, pid: int) -> Row:
        cfg = self.cfg
        run = run_engine(
            self.sb,
            url,
            cfg.eng_streams,
            cfg.eng_tokens,
            cfg.eng_warmup_s,
            cfg.eng_duration_s,
            cfg.eng_drain_s,
            pid,
        )
        return measure(run)


def snapshot_source(dest: Path) -> Path:
    """Copy ``src/sluice`` to ``dest``; every server imports it from there (PYTHONPATH).

    Others may commit while a run takes its ten minutes: one snapshot keeps every server
    of the run on the same code. Fails when the copy is not what Python imports.
    """
    shutil.copytree(
        REPO / "src" / "sluice", dest / "sluice", ignore=shutil.ignore_patterns("__pycache__")
    )
    probe = subprocess.run(
        [sys.executable, "-c", "import sluice; print(sluice.__file__)"],
        env={**os.environ, "PYTHONPATH": str(dest)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    if not probe.stdout.startswith(str(dest)):
        raise SystemExit(
            f"sse_fanout: servers would not import the snapshot: {probe.stdout}{probe.stderr}"
        )
    sys.path.insert(0, str(dest))  # for demo_text_kb() in this process
    return dest


def idle_text(words: int) -> str:
    return " ".join(["a"] * words)


def demo_text_kb(words: int) -> float:
    """Estimated memory our words demo holds per stream because of its text, in KB.

    What a words generation holds once it has sent its first token (measured here with
    tracemalloc, minus the same for a one-word text), the prompt, and two copies of the
    request URL (the ASGI scope's query string and the HTTP parser's buffer). A property of
    the demo backend, not of the SSE path: a real backend holds its own prompt.
    """
    text = idle_text(words)
    url = f"/v1/demo/words?text={quote_plus(text)}&interval_ms=1000"
    _generation_bytes("a")  # warm-up: first-use allocations (caches, lazy imports)
    held = _generation_bytes(text) - _generation_bytes("a")
    return (held + sys.getsizeof(text) + 2 * len(url)) / 1024


def _generation_bytes(text: str) -> int:
    """Bytes allocated by a words generation of ``text`` advanced to its first token."""
    from sluice.backends.base import GenerationRequest
    from sluice.backends.words import WordsBackend

    async def first_token() -> int:
        request = GenerationRequest(prompt=text, interval_s=1.0)
        tracemalloc.start()
        try:
            tokens = WordsBackend().generate(request).__aiter__()
            await anext(tokens)
            held = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
        await tokens.aclose()
        return held

    return asyncio.run(first_token())


def log(t0: float, msg: str) -> None:
    print(f"[{time.monotonic() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def summary_line(test: str, result: Any) -> str:
    if test == "throughput":
        r = result
        return (
            f"{r['events']} events, {r['events_per_s']} ev/s, "
            f"{r['server_sched_cpu_s_per_1m_events']} CPU-s/1M, errors {r['errors']}"
        )
    if test == "concurrency":
        r = result[-1]
        return (
            f"held {r['held']}/{r['target']}, rss/conn {r['rss_per_conn_kb']} KB, "
            f"ramp {r['ramp_s']} s, connect p99 {r['connect_p99_ms']} ms, errors {r['errors']}"
        )
    r = result
    if test == "engine":
        return (
            f"step-to-client p50/p99 {r['e2e_p50_us']}/{r['e2e_p99_us']} us, "
            f"{r['window_tokens_per_s']} tokens/s, delivered {r['tokens_delivered']}/"
            f"{r['tokens_produced']} (dup {r['tokens_duplicated']}), ramp {r['ramp_s']} s, "
            f"errors {r['errors']}"
        )
    return (
        f"e2e p50/p99 {r['e2e_p50_us']}/{r['e2e_p99_us']} us, write path p99 "
        f"{r['krx_p99_us']} us, delivered {r['delivery_ratio']}, errors {r['errors']}"
    )


def run_all(bench: Bench, tests: list[str], t0: float) -> tuple[Runs, list[str]]:
    """Every test R times; the peer order alternates between repetitions."""
    runs: Runs = {t: {p: [] for p in PEERS} for t in tests}
    problems: list[str] = []
    for test in tests:
        for rep in range(bench.cfg.reps):
            for peer in PEERS if rep % 2 == 0 else PEERS[::-1]:
                try:
                    result = bench.run(peer, test)
                except (RuntimeError, OSError) as exc:
                    problems.append(f"{test} rep {rep + 1} {LABELS[peer]}: {exc}")
                    log(t0, problems[-1])
                    continue
                runs[test][peer].append(result)
                log(t0, f"{test} {rep + 1}/{bench.cfg.reps} {peer}: {summary_line(test, result)}")
                time.sleep(0.5)
    return runs, problems


# ---------------------------------------------------------------- report

# The table rows of each test: (label, result key, scale); the target's row comes first.
ROW_SPECS: dict[str, list[tuple[str, str, float]]] = {
    "throughput": [
        ("server CPU s per 1M events (schedstat)", "server_sched_cpu_s_per_1m_events", 1),
        ("server CPU s per 1M events (utime+stime)", "server_cpu_s_per_1m_events", 1),
        ("events/s delivered (all clients)", "events_per_s", 1),
        ("events counted per stream", "events_per_stream", 1),
        ("bytes received per event", "bytes_per_event", 1),
        ("server busy during burst (cores)", "server_busy", 1),
        ("client CPU during burst (cores)", "client_cpu_util", 1),
    ],
    "concurrency": [
        ("server RSS growth per stream (KB)", "rss_per_conn_kb", 1),
        ("  of which the demo text (estimate, KB)", "demo_text_kb", 1),
        ("  RSS growth per stream without it (KB)", "rss_per_conn_ex_text_kb", 1),
        ("RSS growth per stream at each level (KB)", "rss_per_conn_by_level", 1),
        ("held (of N)", "held", 1),
        ("ramp to N (s)", "ramp_s", 1),
        ("connect latency p50 (ms)", "connect_p50_ms", 1),
        ("connect latency p99 (ms)", "connect_p99_ms", 1),
        ("server RSS before / after (MB)", "rss_after_mb", 1),
        ("server CPU while holding (% of 1 core)", "server_cpu_hold_pct", 1),
    ],
    "latency": [
        ("end-to-end p99 (ms, due -> kernel RX)", "e2e_p99_us", 1e-3),
        ("end-to-end p50 (ms)", "e2e_p50_us", 1e-3),
        ("write path p99 (ms, emit -> kernel RX)", "krx_p99_us", 1e-3),
        ("write path p50 (ms)", "krx_p50_us", 1e-3),
        ("tick lateness p99 (ms, emit - due)", "late_p99_us", 1e-3),
        ("delivered / offered events", "delivery_ratio", 1),
        ("streams that got their headers", "ok_streams", 1),
        ("server CPU (% of 1 core)", "server_cpu_pct", 1),
        ("client CPU (cores)", "client_cpu_util", 1),
    ],
    "engine": [
        ("step-to-client p99 (ms, due -> kernel RX)", "e2e_p99_us", 1e-3),
        ("step-to-client p50 (ms)", "e2e_p50_us", 1e-3),
        ("step-to-client p99.9 (ms)", "e2e_p999_us", 1e-3),
        ("write path p99 (ms, emit -> kernel RX)", "krx_p99_us", 1e-3),
        ("step lateness p99 (ms, emit - due)", "late_p99_us", 1e-3),
        ("tokens/s delivered in the window", "window_tokens_per_s", 1),
        ("  of the tokens due in it", "window_delivery_ratio", 1),
        ("tokens delivered (of N x K produced)", "tokens_delivered", 1),
        ("tokens missing / duplicated", "tokens_missing", 1),
        ("streams that got their headers", "ok_streams", 1),
        ("ramp to N (s)", "ramp_s", 1),
        ("server CPU (% of 1 core)", "server_cpu_pct", 1),
        ("client CPU (cores)", "client_cpu_util", 1),
    ],
}


def title(test: str, cfg: Config) -> str:
    if test == "throughput":
        return f"{cfg.tp_clients} clients x {cfg.tp_events} events of {cfg.tp_size} B"
    if test == "concurrency":
        return f"N={max(cfg.levels):,} streams x 1 event/s, hold {cfg.hold_s:g} s per level"
    if test == "engine":
        return (
            f"N={cfg.eng_streams:,} streams x K={cfg.eng_tokens} tokens, one 20 ms timer "
            f"({cfg.eng_streams * 50:,} tokens/s), {cfg.eng_duration_s:g} s window"
        )
    return f"C={cfg.lat_streams:,} streams x {cfg.lat_rate:g} events/s, {cfg.lat_duration_s:g} s"


def median(rows: list[Row], key: str) -> float | None:
    nums = [v for r in rows if isinstance(v := r.get(key), int | float) and not isinstance(v, bool)]
    return statistics.median(nums) if nums else None


def fmt(v: float | None) -> str:
    if v is None:
        return "—"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if abs(v) >= 100:
        return f"{v:.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}" if abs(v) >= 1 else f"{v:.3f}"


def ratio(ours: float | None, base: float | None) -> str:
    return "—" if ours is None or not base else f"{ours / base:.2f}"


def verdict(value: float | None, bound: float) -> str:
    if value is None:
        return "n/a"
    return "**PASS**" if value <= bound else "**MISS**"


def flat_rows(test: str, peer: str, results: list[Any], cfg: Config) -> list[Row]:
    """One row per run (a stepped ramp's top level), with derived fields added."""
    rows = []
    for result in results:
        row = dict(result[-1] if test == "concurrency" else result)
        if test == "throughput" and row.get("events"):
            row["events_per_stream"] = row["events"] / max(row["clients"], 1)
            row["bytes_per_event"] = row["bytes"] / row["events"]
        if test == "concurrency":
            row["rss_per_conn_by_level"] = [level["rss_per_conn_kb"] for level in result]
            if peer == "ours" and row.get("rss_per_conn_kb") is not None:
                row["demo_text_kb"] = demo_text_kb(cfg.idle_words)
                row["rss_per_conn_ex_text_kb"] = row["rss_per_conn_kb"] - row["demo_text_kb"]
        rows.append(row)
    return rows


def cell(rows: list[Row], key: str, scale: float) -> tuple[str, float | None]:
    """A table cell (text, number) from the median over runs."""
    if key == "rss_per_conn_by_level":
        per_level = [r[key] for r in rows]
        medians = [statistics.median(vals) for vals in zip(*per_level, strict=False)]
        return " / ".join(fmt(v) for v in medians) or "—", None
    value = median(rows, key)
    value = None if value is None else value * scale
    if key == "rss_after_mb":
        return f"{fmt(median(rows, 'rss_before_mb'))} / {fmt(value)}", value
    if key == "tokens_missing":
        return f"{fmt(value)} / {fmt(median(rows, 'tokens_duplicated'))}", value
    return fmt(value), value


def table_rows(tests: list[str], runs: Runs, cfg: Config) -> list[str]:
    out = []
    for test in tests:
        per_peer = {p: flat_rows(test, p, runs[test][p], cfg) for p in PEERS}
        n_ours, n_base = (len(per_peer[p]) for p in PEERS)
        out.append(
            f"| **{test}**: {title(test, cfg)} (medians of {n_ours} / {n_base} runs) | | | | | |"
        )
        target_key, bound = TARGETS[test]
        for label, key, scale in ROW_SPECS[test]:
            (ours_s, ours), (base_s, base) = (cell(per_peer[p], key, scale) for p in PEERS)
            target_s = verdict_s = ""
            if key == target_key:
                target_s, verdict_s = f"≤ {fmt(bound * scale)}", verdict(ours, bound * scale)
            out.append(
                f"| {label} | {ours_s} | {base_s} | {ratio(ours, base)} | {target_s} | {verdict_s} |"
            )
    return out


def ratio_notes(tests: list[str], runs: Runs, cfg: Config) -> list[str]:
    """The targets restated as ratios to sse-starlette's RESULTS.md value."""
    notes = []
    for test, base_ref in RESULTS_MD_BASELINE.items():
        if test not in tests:
            continue
        key, bound = TARGETS[test]
        ours, base = (median(flat_rows(test, p, runs[test][p], cfg), key) for p in PEERS)
        if ours is None or not base:
            continue
        want = bound / base_ref
        notes.append(
            f"- {test}: target {bound:g} is {want:.2f} x sse-starlette's {base_ref:g} in "
            f"RESULTS.md; here ours / baseline = {ours / base:.2f} -> "
            f"{'PASS' if ours / base <= want else 'MISS'} as a ratio (baseline here: "
            f"{base:.1f}, {base / base_ref:.2f} x its RESULTS.md value)"
        )
    return notes


def held_problems(tests: list[str], runs: Runs) -> list[str]:
    out = []
    if "concurrency" not in tests:
        return out
    for peer in PEERS:
        for i, result in enumerate(runs["concurrency"][peer]):
            out += [
                f"concurrency run {i + 1} {LABELS[peer]}: held {r['held']} of {r['target']}"
                for r in result
                if r["held"] < r["target"]
            ]
    return out


def token_problems(tests: list[str], runs: Runs) -> list[str]:
    """Engine runs whose tokens did not all arrive exactly once."""
    out = []
    if "engine" not in tests:
        return out
    for peer in PEERS:
        for i, r in enumerate(runs["engine"][peer]):
            if r["tokens_missing"] or r["tokens_duplicated"]:
                out.append(
                    f"engine run {i + 1} {LABELS[peer]}: {r['tokens_missing']} tokens missing "
                    f"and {r['tokens_duplicated']} duplicated of {r['tokens_produced']} "
                    f"({r['streams_incomplete']} streams incomplete after waiting "
                    f"{r['drain_wait_s']} s)"
                )
    return out


def client_errors(tests: list[str], runs: Runs) -> list[str]:
    out = []
    for test in tests:
        for peer in PEERS:
            for i, result in enumerate(runs[test][peer]):
                rows = result if isinstance(result, list) else [result]
                errs = {k: v for r in rows for k, v in (r.get("errors") or {}).items()}
                if errs or any(r.get("timed_out") for r in rows):
                    out.append(f"{test} run {i + 1} {LABELS[peer]}: client-side errors {errs}")
    return out


def all_problems(tests: list[str], runs: Runs, problems: list[str]) -> list[str]:
    """What went wrong in the run: failed measurements, servers that had to be killed or
    logged trouble, streams not held, client-side errors."""
    return (
        problems
        + held_problems(tests, runs)
        + token_problems(tests, runs)
        + client_errors(tests, runs)
    )


def machine_facts(server_nofile: dict[str, str], source: str) -> list[str]:
    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "?"

    cpu = "?"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    pkgs = ["sluice", "uvicorn", "starlette", "sse-starlette", "uvloop", "httptools", "orjson"]
    servers = ", ".join(f"{LABELS[p]} {v}" for p, v in server_nofile.items())
    return [
        f"- machine: nproc {os.cpu_count()} ({cpu}), memory {mem_gib:.1f} GiB, "
        f"Linux {platform.release()}, Python {platform.python_version()}",
        "- versions: " + ", ".join(f"{p} {version(p)}" for p in pkgs),
        f"- sluice source: {source}",
        f"- RLIMIT_NOFILE: client {soft} (hard {hard}); servers {servers or '—'}",
    ]


def git_state() -> str:
    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", *args], cwd=BENCH_DIR, capture_output=True, text=True, timeout=10
        )
        return done.stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "?"
    dirty = git("status", "--porcelain", "--", str(REPO / "src"))
    return f"commit {head}" + (" + uncommitted changes in src/" if dirty else "")


def render(tests: list[str], runs: Runs, problems: list[str], cfg: Config, facts: list[str]) -> str:
    lines = [
        "## SSE fan-out: sluice vs sse-starlette (same ssebench client, same run)",
        "",
        *facts,
        f"- config: {json.dumps(asdict(cfg))}",
        "",
        "| metric | sluice (ours) | sse-starlette | ratio ours/base | target | verdict |",
        "|---|---|---|---|---|---|",
        *table_rows(tests, runs, cfg),
    ]
    notes = ratio_notes(tests, runs, cfg)
    if notes:
        lines += ["", "Targets as ratios (machine-independent view):", *notes]
    problems = all_problems(tests, runs, problems)
    if problems:
        lines += ["", "Problems:", *(f"- {p}" for p in problems)]
    return "\n".join(lines)


# ---------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    default_dir = BENCH_DIR / "ssebench"  # a copy of the shared harness: see its README
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--ssebench-dir",
        type=Path,
        default=default_dir,
        help=f"folder holding ssebench.py and peers/ (default: {default_dir})",
    )
    ap.add_argument("--reps", type=int, default=None, help="repetitions per test (default 3)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 1 rep, 20x200 burst, 500 streams, latency 100 streams x 1 s, "
        "engine 100 streams x 2 s",
    )
    ap.add_argument(
        "--only",
        default=",".join(TESTS),
        help=f"comma list of tests to run (default: {','.join(TESTS)})",
    )
    ap.add_argument(
        "--idle-words",
        type=int,
        default=None,
        help="words in our concurrency streams' text, one event per second, so also their "
        "lifetime in s (default 150)",
    )
    ap.add_argument(
        "--lat-streams",
        type=int,
        default=None,
        help="streams in the latency test (default 1000, the issue's figure)",
    )
    ap.add_argument(
        "--eng-streams",
        type=int,
        default=None,
        help="streams in the engine test (default 1000, the issue's figure)",
    )
    ap.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="PATH",
        help="also write the config, machine facts and every run's raw numbers here",
    )
    args = ap.parse_args(argv)
    args.tests = [t.strip() for t in args.only.split(",") if t.strip()]
    unknown = set(args.tests) - set(TESTS)
    if unknown or not args.tests:
        ap.error(f"--only: choose from {', '.join(TESTS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = Config.quick() if args.quick else Config()
    if args.reps is not None:
        cfg.reps = args.reps
    if args.idle_words is not None:
        cfg.idle_words = args.idle_words
    if args.lat_streams is not None:
        cfg.lat_streams = args.lat_streams
    if args.eng_streams is not None:
        cfg.eng_streams = args.eng_streams
    ssebench_dir = args.ssebench_dir.resolve()
    ssebench = load_ssebench(ssebench_dir)
    nofile = ssebench.raise_nofile()  # the servers inherit it
    if "concurrency" in args.tests and nofile < max(cfg.levels) + 500:
        print(
            f"warning: RLIMIT_NOFILE {nofile} is too low for {max(cfg.levels)} streams",
            file=sys.stderr,
        )
    log_dir = Path(tempfile.mkdtemp(prefix="sse-fanout-logs-"))
    source = git_state() + ", snapshot of src/ taken at start"
    bench = Bench(ssebench, ssebench_dir, cfg, log_dir, snapshot_source(log_dir / "src"))
    gc.disable()  # as ssebench does: the client makes no garbage cycles worth collecting
    t0 = time.monotonic()
    try:
        runs, problems = run_all(bench, args.tests, t0)
    finally:
        for srv in bench.servers:
            srv.stop()
    log(t0, f"done; server logs in {log_dir}")
    problems += [f"server {srv.name} {srv.exit_note}" for srv in bench.servers if srv.exit_note]
    problems += [
        f"{LABELS[p]} log: {line}" for p in PEERS for line in scan_log(log_dir / f"{p}.log")
    ]
    facts = machine_facts(bench.server_nofile, source)
    print(render(args.tests, runs, problems, cfg, facts))
    if args.json:
        doc = {"config": asdict(cfg), "facts": facts, "runs": runs, "problems": problems}
        args.json.write_text(json.dumps(doc, indent=1))
    # A missed target is a figure (PASS/MISS in the table); a problem is a broken run.
    return 1 if all_problems(args.tests, runs, problems) else 0


if __name__ == "__main__":
    sys.exit(main())
