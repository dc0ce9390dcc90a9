"""What one proxy hop adds: client -> Sluice -> source and client -> LiteLLM -> source
against client -> source, in one run.

The source is ``bench/tick_server.py``: ``sluice serve`` whose ``words`` model emits one
token per 20 ms, each token's text being ``"<emit_ns> <seq> <due_ns>"`` (``emit_ns`` from
``time.monotonic_ns()``, one clock for every process on the machine). The hops in front
of it, both speaking the OpenAI API upstream:

- Sluice: ``sluice serve --upstream http://127.0.0.1:<tick port>/v1 --upstream-model words``;
- LiteLLM (the peer): its proxy, ``litellm --config config.yaml``, the model routed as
  ``openai/words`` to the same ``/v1``, in its own virtualenv (``litellm_peer.py``, which
  installs it from PyPI when it is missing).

The same client reads ``POST /v1/chat/completions`` with ``"stream": true`` from the
source directly and through each hop, at 1 and at ``--streams`` concurrent streams of
``--tokens`` tokens each:

- TTFT: request sent -> first content chunk received;
- token latency: ``emit_ns`` at the source -> chunk received by the client;
- inter-token gap: between consecutive chunks of one stream, as received;
- proxy CPU per token: the hop's process tree's CPU seconds (``/proc``, every thread)
  over the level's streams, divided by the tokens the client got through it.

"added" is hop minus direct, per percentile; each figure is the median over ``--reps``
repetitions, the order of direct / Sluice / LiteLLM rotating between repetitions. The
issue's targets for the Sluice hop at the top level: at most +1 ms p50 and +5 ms p99 per
token, +5 ms p50 TTFT, and at most a quarter of LiteLLM's proxy CPU per token (PASS/MISS
in the table; a MISS is a figure, not a failure). Problems (exit status 1): streams that
failed or came back short, a peer that could not be installed or started, a server that
had to be killed or logged trouble.

    .venv/bin/python bench/proxy_overhead.py            # ~4 min
    .venv/bin/python bench/proxy_overhead.py --quick    # a smoke run, ~1 min (LiteLLM's start)
    .venv/bin/python bench/proxy_overhead.py --no-litellm   # direct and Sluice only
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson

import litellm_peer
from peers import (
    HOST,
    ServerProcess,
    free_port,
    ours_command,
    process_cpu_s,
    scan_log,
    tick_command,
)

MODEL = "words"
HOPS = ("direct", "sluice", "litellm")
LABELS = {"direct": "direct", "sluice": "Sluice hop", "litellm": "LiteLLM hop"}
# The targets for the Sluice hop at the top level (ms added; CPU as a ratio).
TARGET_TOKEN_P50_MS = 1.0
TARGET_TOKEN_P99_MS = 5.0
TARGET_TTFT_P50_MS = 5.0
TARGET_CPU_RATIO = 0.25


@dataclass
class Sample:
    """One level's streams through one hop."""

    ttft_ms: list[float] = field(default_factory=list)
    latency_ms: list[float] = field(default_factory=list)
    gap_ms: list[float] = field(default_factory=list)
    errors: int = 0
    proxy_cpu_s: float | None = None  # the hop's CPU over the streams; None: direct

    @property
    def cpu_us_per_token(self) -> float | None:
        if self.proxy_cpu_s is None or not self.latency_ms:
            return None
        return self.proxy_cpu_s / len(self.latency_ms) * 1e6


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def one_stream(
    client: httpx.AsyncClient, url: str, tokens: int, sample: Sample, headers: dict[str, str]
) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tick"}],
        "max_tokens": tokens,
        "stream": True,
    }
    sent = time.monotonic_ns()
    last: int | None = None
    seen = 0
    async with client.stream("POST", url, json=body, headers=headers) as response:
        if response.status_code != 200:
            sample.errors += 1
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.monotonic_ns()
            chunk = orjson.loads(line[6:])
            if not chunk["choices"]:
                continue
            content = chunk["choices"][0]["delta"].get("content")
            if not content:
                continue
            emit_ns = int(content.split()[0])
            if last is None:
                sample.ttft_ms.append((now - sent) / 1e6)
            else:
                sample.gap_ms.append((now - last) / 1e6)
            sample.latency_ms.append((now - emit_ns) / 1e6)
            last = now
            seen += 1
    if seen != tokens:
        sample.errors += 1


async def measure(
    base_url: str, streams: int, tokens: int, headers: dict[str, str], proxy_pid: int | None
) -> Sample:
    sample = Sample()
    limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=streams + 8)
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:
        url = f"{base_url}/v1/chat/completions"
        await one_stream(client, url, 2, Sample(), headers)  # warm the connection pool
        cpu_before = None if proxy_pid is None else process_cpu_s(proxy_pid)
        await asyncio.gather(
            *(one_stream(client, url, tokens, sample, headers) for _ in range(streams))
        )
        if proxy_pid is not None and cpu_before is not None:
            sample.proxy_cpu_s = process_cpu_s(proxy_pid) - cpu_before
    return sample


# ---------------------------------------------------------------- report


def _fmt(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "—"
    return f"{value:+.2f}" if signed else f"{value:.2f}"


class Report:
    """The medians over repetitions, one table."""

    def __init__(self, results: dict[tuple[str, int], list[Sample]], hops: tuple[str, ...]):
        self.results = results
        self.hops = hops

    def latency(self, hop: str, level: int, metric: str, q: float) -> float | None:
        samples = [s for s in self.results.get((hop, level), []) if getattr(s, metric)]
        if not samples:
            return None
        return statistics.median(pct(getattr(s, metric), q) for s in samples)

    def cpu_us(self, hop: str, level: int) -> float | None:
        values = [
            v for s in self.results.get((hop, level), []) if (v := s.cpu_us_per_token) is not None
        ]
        return statistics.median(values) if values else None

    def rows(self, level: int, top: bool) -> list[str]:
        out = []
        for metric, name in (
            ("ttft_ms", "TTFT"),
            ("latency_ms", "token latency"),
            ("gap_ms", "inter-token gap"),
        ):
            for q in (50, 99):
                direct = self.latency("direct", level, metric, q)
                cells = [_fmt(direct)]
                added: dict[str, float | None] = {}
                for hop in ("sluice", "litellm"):
                    value = self.latency(hop, level, metric, q) if hop in self.hops else None
                    added[hop] = None if value is None or direct is None else value - direct
                    cells += [_fmt(value), _fmt(added[hop], signed=True)]
                target = self.target(metric, q, added["sluice"]) if top else ""
                out.append(f"| {level} | {name} p{q} (ms) | {' | '.join(cells)} | {target} |")
        ours, peer = self.cpu_us("sluice", level), self.cpu_us("litellm", level)
        out.append(
            f"| {level} | proxy CPU per token (µs) | — | {_fmt(ours)} | | {_fmt(peer)} | | |"
        )
        ratio = None if ours is None or not peer else ours / peer
        target = ""
        if top:
            bound = f"≤ {TARGET_CPU_RATIO:g}"
            target = f"{bound}: {'n/a' if ratio is None else _verdict(ratio <= TARGET_CPU_RATIO)}"
        out.append(
            f"| {level} | Sluice CPU / LiteLLM CPU per token | | {_fmt(ratio)} | | | | {target} |"
        )
        return out

    @staticmethod
    def target(metric: str, q: int, added: float | None) -> str:
        bounds = {
            ("latency_ms", 50): TARGET_TOKEN_P50_MS,
            ("latency_ms", 99): TARGET_TOKEN_P99_MS,
            ("ttft_ms", 50): TARGET_TTFT_P50_MS,
        }
        bound = bounds.get((metric, q))
        if bound is None:
            return ""
        verdict = "n/a" if added is None else _verdict(added <= bound)
        return f"≤ +{bound:g} ms: {verdict}"

    def table(self, levels: tuple[int, ...]) -> str:
        lines = [
            "| streams | metric | direct | Sluice hop | added | LiteLLM hop | added | "
            "target (Sluice hop) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for level in levels:
            lines += self.rows(level, top=level == levels[-1])
        return "\n".join(lines)


def _verdict(ok: bool) -> str:
    return "**PASS**" if ok else "**MISS**"


# ---------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=64, help="the concurrent level")
    parser.add_argument("--tokens", type=int, default=100, help="tokens per stream")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 rep of 30 tokens, 1 and 8 streams")
    parser.add_argument(
        "--no-litellm", action="store_true", help="leave the LiteLLM hop out (direct and Sluice)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.reps, args.tokens, args.streams = 1, 30, 8
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problems: list[str] = []
    hops: tuple[str, ...] = HOPS
    litellm: Path | None = None
    if not args.no_litellm:
        try:
            litellm = litellm_peer.ensure_venv(lambda line: print(line, flush=True))
        except (RuntimeError, OSError, TimeoutError) as exc:
            problems.append(f"LiteLLM could not be installed: {exc}")
    if litellm is None:
        hops = ("direct", "sluice")

    logs = Path(tempfile.mkdtemp(prefix="proxy-overhead-"))
    tick_port = free_port()
    upstream = f"http://{HOST}:{tick_port}/v1"
    tick = ServerProcess("tick", tick_command(tick_port), tick_port, "/healthz", logs / "tick.log")
    sluice_port = free_port()
    sluice_cmd = ours_command(sluice_port, "--upstream", upstream, "--upstream-model", MODEL)
    servers = {
        "direct": tick,
        "sluice": ServerProcess("sluice", sluice_cmd, sluice_port, "/healthz", logs / "sluice.log"),
    }
    headers: dict[str, str] = {}
    if litellm is not None:
        peer = litellm_peer.proxy(litellm, logs, free_port(), upstream, MODEL)
        servers["litellm"] = peer
        headers["authorization"] = f"Bearer {peer.master_key}"  # the other two ignore it
    levels = (1, args.streams)
    results: dict[tuple[str, int], list[Sample]] = {}
    with ExitStack() as stack:
        for hop in hops:
            try:
                stack.enter_context(servers[hop])
            except RuntimeError as exc:
                problems.append(f"{LABELS[hop]} did not start: {exc}")
                hops = tuple(h for h in hops if h != hop)
        if "direct" in hops:
            for rep in range(args.reps):
                for level in levels:
                    shift = rep % len(hops)  # rotate who goes first
                    for hop in hops[shift:] + hops[:shift]:
                        server = servers[hop]
                        pid = None if hop == "direct" else server.pid
                        url = f"http://{HOST}:{server.port}"
                        sample = asyncio.run(measure(url, level, args.tokens, headers, pid))
                        results.setdefault((hop, level), []).append(sample)
                        cpu = sample.cpu_us_per_token
                        print(
                            f"rep {rep + 1} {hop:7} x{level}: {len(sample.latency_ms)} tokens, "
                            f"{sample.errors} errors"
                            + ("" if cpu is None else f", {cpu:.1f} CPU-µs per token"),
                            flush=True,
                        )

    print()
    print(Report(results, hops).table(levels))
    for hop in hops:
        count = sum(s.errors for level in levels for s in results.get((hop, level), []))
        if count:
            problems.append(f"{LABELS[hop]}: {count} streams failed or came back short")
    for server in servers.values():
        if server.exit_note:
            problems.append(f"server {server.name} {server.exit_note}")
        problems += [f"{server.name} log: {line}" for line in scan_log(server.log_path)]
    if problems:
        print(f"\nProblems (logs in {logs}):\n" + "\n".join(f"- {p}" for p in problems))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
