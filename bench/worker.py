"""What a gRPC engine worker adds per token: ``sluice serve --worker`` against the engine in-process.

Two set-ups serve the bundled ``sluice-tiny`` at greedy, on 127.0.0.1:

- **in-process** (the peer): ``sluice serve --model models/sluice-tiny``, the engine in the
  server's own process;
- **gateway -> worker**: ``sluice worker --model models/sluice-tiny`` and ``sluice serve
  --worker grpc://...`` in front of it: each token crosses a gRPC stream (vLLM's engine
  protocol) before the gateway detokenizes it and writes it as SSE.

For each concurrency, N clients each create a native stream (``POST /v1/streams``, the same
prompt per client index on both set-ups, ``max_tokens`` K with ``ignore_eos``) and read its
SSE events, timing the first token and every gap after it. Reported per set-up: time to
first token and inter-token latency (p50, p99, across every gap of every stream), tokens
per second of all streams together, and the CPU the server side used per token (the
server's process; the gateway's plus the worker's for the second set-up), from /proc.

Exit status 1 when a stream failed or fell short, when a greedy text differs between the
two set-ups, or when a server logged trouble; figures are printed, never judged.

Run: ``python bench/worker.py [--quick]`` (``--quick``: 8 streams of 48 tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson

from peers import HOST, ServerProcess, WorkerChild, free_port, process_cpu_s, scan_log

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "models" / "sluice-tiny"
PROMPTS = (
    "Return the number of",
    "Create a new socket using the given address family",
    "Read up to n bytes from the file",
    "The default value is",
)


@dataclass
class Sample:
    """One stream at the client: its text, when its tokens came, how it ended."""

    text: str = ""
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    num_events: int = 0  # token events (a token that ends mid-character makes none)
    num_tokens: int = 0  # as its usage event says
    ended: str = ""


async def one_stream(client: httpx.AsyncClient, base: str, index: int, max_tokens: int) -> Sample:
    body = {
        "prompt": PROMPTS[index % len(PROMPTS)],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    sample = Sample()
    started = time.perf_counter()
    created = (await client.post(f"{base}/v1/streams", json=body)).json()
    last = started
    event = ""
    async with client.stream("GET", f"{base}{created['events_url']}") as response:
        async for line in response.aiter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:") and event == "token":
                now = time.perf_counter()
                if sample.ttft_s is None:
                    sample.ttft_s = now - started
                else:
                    sample.gaps_s.append(now - last)
                last = now
                sample.text += orjson.loads(line[5:])["text"]
                sample.num_events += 1
            elif line.startswith("data:") and event == "usage":
                sample.num_tokens = orjson.loads(line[5:])["completion_tokens"]
            elif line.startswith("data:") and event in ("done", "error"):
                sample.ended = f"{event} {line[5:].strip()}"
    return sample


async def measure(base: str, concurrency: int, max_tokens: int) -> list[Sample]:
    limits = httpx.Limits(max_connections=2 * concurrency + 4)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        return list(
            await asyncio.gather(
                *(one_stream(client, base, i, max_tokens) for i in range(concurrency))
            )
        )


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


@dataclass
class Figures:
    ttft_p50_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    tokens_per_s: float
    cpu_ms_per_token: float


def figures(samples: list[Sample], wall_s: float, cpu_s: float) -> Figures:
    ttfts = [s.ttft_s for s in samples if s.ttft_s is not None]
    gaps = [gap for s in samples for gap in s.gaps_s]
    num_tokens = sum(s.num_tokens for s in samples)
    return Figures(
        ttft_p50_ms=statistics.median(ttfts) * 1000 if ttfts else float("nan"),
        itl_p50_ms=pct(gaps, 0.5) * 1000,
        itl_p99_ms=pct(gaps, 0.99) * 1000,
        tokens_per_s=num_tokens / wall_s,
        cpu_ms_per_token=cpu_s * 1000 / max(1, num_tokens),
    )


def serve_command(port: int, *options: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "sluice.cli",
        "serve",
        "--host",
        HOST,
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--drain-timeout",
        "2",
        *options,
    ]


def run_setup(
    name: str, logs: Path, levels: list[int], max_tokens: int
) -> tuple[dict[int, Figures], dict[int, list[Sample]], list[str]]:
    """Measure one set-up at every concurrency; its figures, samples and log trouble."""
    results: dict[int, Figures] = {}
    samples: dict[int, list[Sample]] = {}
    port = free_port()
    with contextlib.ExitStack() as stack:
        pids = []
        if name == "worker":
            worker = stack.enter_context(WorkerChild(MODEL, logs / "worker.log"))
            assert worker.process is not None
            pids.append(worker.process.pid)
            command = serve_command(port, "--no-model", "--worker", f"grpc://{HOST}:{worker.port}")
            command += ["--worker-connect-timeout", "180"]
        else:
            command = serve_command(port, "--model", str(MODEL))
        server = ServerProcess(
            name, command, port, "/readyz", logs / f"{name}.log", ready_timeout_s=240, cwd=REPO
        )
        stack.enter_context(server)
        pids.append(server.pid)
        base = f"http://{HOST}:{port}"
        asyncio.run(measure(base, 2, 8))  # warm-up
        for level in levels:
            cpu_before = sum(process_cpu_s(pid) for pid in pids)
            started = time.perf_counter()
            samples[level] = asyncio.run(measure(base, level, max_tokens))
            wall_s = time.perf_counter() - started
            cpu_s = sum(process_cpu_s(pid) for pid in pids) - cpu_before
            results[level] = figures(samples[level], wall_s, cpu_s)
    trouble = scan_log(logs / f"{name}.log") + (
        scan_log(logs / "worker.log") if name == "worker" else []
    )
    return results, samples, trouble


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 streams of 48 tokens")
    args = parser.parse_args(argv)
    levels, max_tokens = ([8], 48) if args.quick else ([1, 8, 32], 200)
    logs = Path(tempfile.mkdtemp(prefix="bench-worker-"))
    local, local_samples, local_trouble = run_setup("in-process", logs, levels, max_tokens)
    remote, remote_samples, remote_trouble = run_setup("worker", logs, levels, max_tokens)
    problems = [f"in-process log: {line}" for line in local_trouble]
    problems += [f"worker set-up log: {line}" for line in remote_trouble]
    print(f"sluice-tiny, greedy, {max_tokens} tokens per stream (ignore_eos); logs in {logs}\n")
    print("| streams | metric | in-process | gateway -> worker | added |")
    print("|---|---|---|---|---|")
    for level in levels:
        a, b = local[level], remote[level]
        rows = [
            ("TTFT p50 (ms)", a.ttft_p50_ms, b.ttft_p50_ms),
            ("inter-token p50 (ms)", a.itl_p50_ms, b.itl_p50_ms),
            ("inter-token p99 (ms)", a.itl_p99_ms, b.itl_p99_ms),
            ("tokens/s, all streams", a.tokens_per_s, b.tokens_per_s),
            ("server CPU per token (ms)", a.cpu_ms_per_token, b.cpu_ms_per_token),
        ]
        for metric, x, y in rows:
            print(f"| {level} | {metric} | {x:.2f} | {y:.2f} | {y - x:+.2f} |")
        for i, (s, t) in enumerate(zip(local_samples[level], remote_samples[level], strict=True)):
            for where, sample in (("in-process", s), ("worker", t)):
                if sample.num_tokens != max_tokens or not sample.ended.startswith("done"):
                    problems.append(
                        f"{where} stream {i}: {sample.num_tokens} tokens, ended {sample.ended!r}"
                    )
            if s.text != t.text:
                problems.append(f"stream {i}: the texts differ: {s.text!r} vs {t.text!r}")
        equal = all(
            s.text == t.text
            for s, t in zip(local_samples[level], remote_samples[level], strict=True)
        )
        print(f"| {level} | greedy texts equal | | {'yes' if equal else 'NO'} | |")
    for problem in problems:
        print(f"PROBLEM: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
