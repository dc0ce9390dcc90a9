"""What one Sluice hop adds: client -> Sluice proxy -> Sluice vs client -> Sluice, in one run.

The source is ``bench/tick_server.py``: ``sluice serve`` whose ``words`` model emits one
token per 20 ms, each token's text being ``"<emit_ns> <seq> <due_ns>"`` (``emit_ns`` from
``time.monotonic_ns()``, one clock for every process on the machine). The proxy is
``sluice serve --upstream http://127.0.0.1:<tick port>/v1 --upstream-model words``. The
same client reads ``POST /v1/chat/completions`` with ``"stream": true`` (the OpenAI
dialect, what the proxy speaks upstream) from each, at 1 and at ``--streams`` concurrent
streams of ``--tokens`` tokens:

- TTFT: request sent -> first content chunk received;
- token latency: ``emit_ns`` at the source -> chunk received by the client;
- inter-token gap: between consecutive chunks of one stream, as received.

"added" is proxied minus direct, per percentile; each figure is the median over ``--reps``
repetitions, with direct and proxied runs alternating. The issue's target: the hop adds
at most 1 ms at p50 and 5 ms at p99 (PASS/MISS in the table). Problems (exit status 1):
streams that failed or came back short, a server that had to be killed or logged trouble.

    .venv/bin/python bench/proxy_overhead.py            # ~2 min
    .venv/bin/python bench/proxy_overhead.py --quick    # a smoke run, ~15 s
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson

from peers import HOST, ServerProcess, free_port, ours_command, scan_log, tick_command

MODEL = "words"


@dataclass
class Sample:
    ttft_ms: list[float]
    latency_ms: list[float]
    gap_ms: list[float]
    errors: int


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def one_stream(client: httpx.AsyncClient, url: str, tokens: int, sample: Sample) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tick"}],
        "max_tokens": tokens,
        "stream": True,
    }
    sent = time.monotonic_ns()
    last: int | None = None
    seen = 0
    async with client.stream("POST", url, json=body) as response:
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


async def measure(base_url: str, streams: int, tokens: int) -> Sample:
    sample = Sample([], [], [], 0)
    limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=streams + 8)
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:
        url = f"{base_url}/v1/chat/completions"
        await one_stream(client, url, 2, Sample([], [], [], 0))  # warm the connection pool
        await asyncio.gather(*(one_stream(client, url, tokens, sample) for _ in range(streams)))
    return sample


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=64, help="the concurrent level")
    parser.add_argument("--tokens", type=int, default=100, help="tokens per stream")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 rep of 30 tokens, 1 and 8 streams")
    args = parser.parse_args(argv)
    if args.quick:
        args.reps, args.tokens, args.streams = 1, 30, 8

    logs = Path(tempfile.mkdtemp(prefix="proxy-overhead-"))
    tick_port, proxy_port = free_port(), free_port()
    tick = ServerProcess("tick", tick_command(tick_port), tick_port, "/healthz", logs / "tick.log")
    proxy_cmd = ours_command(
        proxy_port, "--upstream", f"http://{HOST}:{tick_port}/v1", "--upstream-model", MODEL
    )
    proxy = ServerProcess("proxy", proxy_cmd, proxy_port, "/healthz", logs / "proxy.log")
    results: dict[tuple[str, int], list[Sample]] = {}
    with tick, proxy:
        for rep in range(args.reps):
            for level in (1, args.streams):
                order = [("direct", tick_port), ("proxied", proxy_port)]
                if rep % 2:
                    order.reverse()
                for name, port in order:
                    sample = asyncio.run(measure(f"http://{HOST}:{port}", level, args.tokens))
                    results.setdefault((name, level), []).append(sample)
                    print(
                        f"rep {rep + 1} {name:7} x{level}: {len(sample.latency_ms)} tokens, "
                        f"{sample.errors} errors",
                        flush=True,
                    )

    def figure(name: str, level: int, metric: str, q: float) -> float:
        return statistics.median(pct(getattr(s, metric), q) for s in results[(name, level)])

    print(
        "\n| streams | metric | direct p50 | proxied p50 | added p50 | direct p99 | "
        "proxied p99 | added p99 | target |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    verdicts = []
    for level in (1, args.streams):
        for metric, label in (
            ("ttft_ms", "TTFT"),
            ("latency_ms", "token latency"),
            ("gap_ms", "inter-token gap"),
        ):
            d50, p50 = figure("direct", level, metric, 50), figure("proxied", level, metric, 50)
            d99, p99 = figure("direct", level, metric, 99), figure("proxied", level, metric, 99)
            ok = (p50 - d50) <= 1.0 and (p99 - d99) <= 5.0
            verdicts.append(ok)
            target = f"+1 / +5 ms: {'PASS' if ok else 'MISS'}"
            print(
                f"| {level} | {label} (ms) | {d50:.2f} | {p50:.2f} | {p50 - d50:+.2f} | "
                f"{d99:.2f} | {p99:.2f} | {p99 - d99:+.2f} | {target} |"
            )
    problems = []
    errors = sum(s.errors for samples in results.values() for s in samples)
    if errors:
        problems.append(f"{errors} streams failed or came back short (logs in {logs})")
    for server in (tick, proxy):
        if server.exit_note:
            problems.append(f"server {server.name} {server.exit_note}")
        problems += [f"{server.name} log: {line}" for line in scan_log(server.log_path)]
    if problems:
        print("\nProblems:\n" + "\n".join(f"- {p}" for p in problems))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
