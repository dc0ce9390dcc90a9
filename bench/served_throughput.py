"""Served output tokens/s of ``sluice-tiny``: the engine in the server's process or in its own.

The workload of the engine peers' serving rows (``../shared/reports/engine_peers.md``, there
driven by ``vllm bench serve``): 128-token prompts, 128 output tokens with ``ignore_eos``,
greedy, streamed ``POST /v1/completions``, a closed loop of C concurrent requests (2 x C
requests a level, at least 8), with an aiohttp client as vLLM's bench uses. Set-ups, all
serving ``models/sluice-tiny`` on 127.0.0.1 and each started once:

- **engine alone** (the ceiling): the same prompts straight into ``AsyncEngine`` in a
  child process of the bench, no HTTP, with the torch threads ``sluice serve`` gives it;
- **one process**: ``sluice serve --model models/sluice-tiny --no-engine-process``: HTTP,
  SSE and the engine's thread share one interpreter and its GIL;
- **two processes**: ``sluice worker --model models/sluice-tiny`` and ``sluice serve
  --no-model --worker grpc://...`` in front of it, started by hand;
- **--engine-process**: ``sluice serve --model models/sluice-tiny --engine-process``: the
  same split, made by ``sluice serve`` itself (``sluice.engine_process``).

The set-ups take turns, run after run, so that a change in the machine's load falls on all
of them. Reported per set-up and level: median output tokens/s of the runs (and each run's),
TTFT p50, the server side's CPU per output token (every process of the set-up, from
/proc), and the ratios to one process and to the engine alone: the median over runs of
the ratio within a run (paired, so a busy minute of a shared machine falls on both sides). Exit status 1 when a request
failed or fell short, when a greedy text differs between set-ups, or when a server logged
trouble; figures are printed, never judged.

Run: ``python bench/served_throughput.py [--quick] [--runs N] [--levels 1,64]``
(``--quick``: levels 1 and 8, 32 output tokens, one run; about a minute).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import inspect
import math
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson
from tokenizers import Tokenizer

from peers import HOST, ServerProcess, WorkerChild, free_port, process_cpu_s, scan_log

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "models" / "sluice-tiny"
PROMPT_TOKENS = 128
PROMPT_MODULES = ("argparse", "asyncio", "collections", "json", "logging", "pathlib", "socket")
SETUPS = ("engine alone", "one process", "two processes", "--engine-process")
ONE_PROCESS_OPTIONS = ("--no-engine-process",)


def make_prompts(count: int, length: int, seed: int = 0) -> list[str]:
    """``count`` texts that ``sluice-tiny``'s tokenizer encodes as exactly ``length`` tokens:
    slices of some standard modules' docstrings (as ``bench/engine_throughput.py``)."""
    tokenizer = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    docs = []
    for name in PROMPT_MODULES:
        module = importlib.import_module(name)
        docs.append(inspect.getdoc(module) or "")
        docs += [
            inspect.getdoc(getattr(module, a)) or "" for a in sorted(vars(module)) if a[0] != "_"
        ]
    ids = tokenizer.encode("\n\n".join(d for d in docs if d)).ids
    rng = random.Random(seed)
    prompts: list[str] = []
    while len(prompts) < count:
        start = rng.randrange(len(ids) - length)
        text = tokenizer.decode(ids[start : start + length])
        if len(tokenizer.encode(text).ids) == length:  # re-encodes to the same length
            prompts.append(text)
    return prompts


@dataclass
class Sample:
    """One request at the client."""

    text: str = ""
    ttft_s: float | None = None
    num_tokens: int = 0  # completion_tokens of the usage chunk
    error: str = ""


async def one_request(
    session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int
) -> Sample:
    body = {
        "model": "sluice-tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sample = Sample()
    started = time.perf_counter()
    parts: list[str] = []
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                sample.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return sample
            async for line in response.content:
                if not line.startswith(b"data:") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = orjson.loads(line[5:])
                if chunk.get("error"):
                    sample.error = str(chunk["error"])[:200]
                for choice in chunk.get("choices") or ():
                    if choice.get("text"):
                        if sample.ttft_s is None:
                            sample.ttft_s = time.perf_counter() - started
                        parts.append(choice["text"])
                if chunk.get("usage"):
                    sample.num_tokens = chunk["usage"]["completion_tokens"]
    except (TimeoutError, aiohttp.ClientError) as exc:
        sample.error = f"{type(exc).__name__}: {exc}"
    sample.text = "".join(parts)
    return sample


async def closed_loop(
    base: str, prompts: list[str], concurrency: int, max_tokens: int
) -> tuple[list[Sample], float]:
    """Every prompt once, ``concurrency`` at a time; the samples in prompt order, and the
    wall time."""
    url = f"{base}/v1/completions"
    samples: list[Sample] = [Sample() for _ in prompts]
    next_index = iter(range(len(prompts)))
    connector = aiohttp.TCPConnector(limit=concurrency + 4)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def client() -> None:
            for index in next_index:
                samples[index] = await one_request(session, url, prompts[index], max_tokens)

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return samples, time.perf_counter() - started


@dataclass
class Level:
    """One set-up at one concurrency, over the runs."""

    tokens_per_s: list[float] = field(default_factory=list)
    ttft_p50_ms: list[float] = field(default_factory=list)
    cpu_ms_per_token: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # of the first run, in prompt order


def serve_command(port: int, *options: str) -> list[str]:
    return [
        sys.executable, "-m", "sluice.cli", "serve", "--host", HOST, "--port", str(port),
        "--log-level", "warning", "--drain-timeout", "2", *options,
    ]  # fmt: skip


@dataclass
class Setup:
    """The processes of one set-up, started."""

    name: str
    base: str
    pids: list[int]
    logs: list[Path]


def start_setup(name: str, logs: Path, stack: contextlib.ExitStack) -> Setup:
    port = free_port()
    log = logs / f"{name.strip('-').replace(' ', '-')}.log"
    pids: list[int] = []
    paths = [log]
    if name == "two processes":
        worker = stack.enter_context(WorkerChild(MODEL, logs / "worker.log"))
        assert worker.process is not None
        pids.append(worker.process.pid)
        paths.append(worker.log_path)
        options = ["--no-model", "--worker", f"grpc://{HOST}:{worker.port}"]
        options += ["--worker-connect-timeout", "180"]
    elif name == "--engine-process":
        options = ["--model", str(MODEL), "--engine-process"]
    else:
        options = ["--model", str(MODEL), *ONE_PROCESS_OPTIONS]
    command = serve_command(port, *options)
    server = ServerProcess(name, command, port, "/readyz", log, ready_timeout_s=240, cwd=REPO)
    stack.enter_context(server)
    pids.append(server.pid)
    return Setup(name, f"http://{HOST}:{port}", pids, paths)


def engine_alone(concurrency: int, max_tokens: int) -> None:
    """The ceiling: the same requests straight into the engine (``AsyncEngine``, as ``sluice
    serve`` builds it, one torch thread as its ``--engine-threads`` default here), no HTTP.
    Runs in a child process (``--engine-alone C K``); prints its figures as JSON."""
    import os

    import torch

    from sluice.engine.driver import AsyncEngine
    from sluice.engine.loader import load_checkpoint
    from sluice.engine.sampling_params import SamplingParams

    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) - 1))
    checkpoint = load_checkpoint(MODEL)
    prompts = [
        checkpoint.tokenizer.encode(p)
        for p in make_prompts(max(8, 2 * concurrency), PROMPT_TOKENS, seed=concurrency)
    ]
    params = SamplingParams(max_tokens, temperature=0, ignore_eos=True)

    async def run() -> dict[str, object]:
        engine = checkpoint.engine(num_blocks=1024, max_num_seqs=64)
        async with AsyncEngine(engine) as driver:
            texts = [""] * len(prompts)
            counts = [0] * len(prompts)
            next_index = iter(range(len(prompts)))

            async def client() -> None:
                for index in next_index:
                    stream = await driver.add_request(prompts[index], params)
                    async for output in stream:
                        texts[index] += output.new_text
                        counts[index] = output.num_completion_tokens

            warm = await driver.add_request(prompts[0][:8], SamplingParams(8, temperature=0))
            async for _ in warm:
                pass
            cpu_before = time.process_time()
            started = time.perf_counter()
            await asyncio.gather(*(client() for _ in range(concurrency)))
            wall_s = time.perf_counter() - started
            cpu_s = time.process_time() - cpu_before
        return {"tokens": sum(counts), "wall_s": wall_s, "cpu_s": cpu_s, "texts": texts}

    sys.stdout.write(orjson.dumps(asyncio.run(run())).decode() + "\n")


def measure_alone(level: Level, concurrency: int, max_tokens: int, problems: list[str]) -> None:
    command = [sys.executable, __file__, "--engine-alone", str(concurrency), str(max_tokens)]
    done = subprocess.run(command, capture_output=True, cwd=REPO, timeout=600, check=False)
    if done.returncode != 0:
        problems.append(f"engine alone: exit {done.returncode}: {done.stderr.decode()[-400:]}")
        return
    result = orjson.loads(done.stdout.splitlines()[-1])
    level.tokens_per_s.append(result["tokens"] / result["wall_s"])
    level.ttft_p50_ms.append(float("nan"))
    level.cpu_ms_per_token.append(result["cpu_s"] * 1000 / max(1, result["tokens"]))
    if not level.texts:
        level.texts = result["texts"]
    if result["tokens"] != max_tokens * len(result["texts"]):
        problems.append(f"engine alone, {concurrency} streams: {result['tokens']} tokens")


def measure(setup: Setup, level: Level, prompts: list[str], concurrency: int, max_tokens: int,
            problems: list[str]) -> None:  # fmt: skip
    cpu_before = sum(process_cpu_s(pid) for pid in setup.pids)
    samples, wall_s = asyncio.run(closed_loop(setup.base, prompts, concurrency, max_tokens))
    cpu_s = sum(process_cpu_s(pid) for pid in setup.pids) - cpu_before
    num_tokens = sum(s.num_tokens for s in samples)
    level.tokens_per_s.append(num_tokens / wall_s)
    ttfts = [s.ttft_s for s in samples if s.ttft_s is not None]
    level.ttft_p50_ms.append(statistics.median(ttfts) * 1000 if ttfts else float("nan"))
    level.cpu_ms_per_token.append(cpu_s * 1000 / max(1, num_tokens))
    if not level.texts:
        level.texts = [s.text for s in samples]
    for i, sample in enumerate(samples):
        if sample.error or sample.num_tokens != max_tokens:
            problems.append(
                f"{setup.name}, {concurrency} streams, request {i}: {sample.num_tokens} tokens"
                f"{', ' + sample.error if sample.error else ''}"
            )


def _ms(value: float) -> str:
    return "—" if math.isnan(value) else f"{value:.0f}"


def paired_ratio(level: Level, base: Level) -> float:
    """The median over runs of this set-up's tokens/s over the base's in the same run (the
    set-ups take turns, so a run's pair saw about the same machine)."""
    pairs = zip(level.tokens_per_s, base.tokens_per_s, strict=False)
    return statistics.median(x / y for x, y in pairs) if base.tokens_per_s else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="levels 1 and 8, 32 tokens, 1 run")
    parser.add_argument("--runs", type=int, default=None, help="runs per set-up (default 3)")
    parser.add_argument("--levels", default=None, help="concurrencies (default 1,64)")
    parser.add_argument(
        "--setups",
        default=",".join(SETUPS),
        help=f"comma-separated, of: {', '.join(SETUPS)} (greedy texts are checked against the first)",
    )
    parser.add_argument("--engine-alone", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.engine_alone:
        engine_alone(*args.engine_alone)
        return 0
    levels = [1, 8] if args.quick else [1, 64]
    if args.levels:
        levels = [int(level) for level in args.levels.split(",")]
    runs = args.runs or (1 if args.quick else 3)
    max_tokens = 32 if args.quick else 128
    names = [name.strip() for name in args.setups.split(",")]
    unknown = sorted(set(names) - set(SETUPS))
    if unknown:
        parser.error(f"unknown set-ups: {unknown}")
    prompts = {c: make_prompts(max(8, 2 * c), PROMPT_TOKENS, seed=c) for c in levels}
    logs = Path(tempfile.mkdtemp(prefix="bench-served-"))
    results = {(name, c): Level() for name in names for c in levels}
    problems: list[str] = []
    with contextlib.ExitStack() as stack:
        setups = [start_setup(name, logs, stack) for name in names if name != "engine alone"]
        for setup in setups:  # warm-up: the first requests' one-time costs
            asyncio.run(closed_loop(setup.base, prompts[levels[0]][:2], 2, 8))
        for _ in range(runs):
            for c in levels:
                if "engine alone" in names:
                    measure_alone(results["engine alone", c], c, max_tokens, problems)
                for setup in setups:
                    measure(setup, results[setup.name, c], prompts[c], c, max_tokens, problems)
    for setup in setups:
        problems += [f"{path.name}: {line}" for path in setup.logs for line in scan_log(path)]
    print(
        f"sluice-tiny, {PROMPT_TOKENS} prompt + {max_tokens} output tokens (ignore_eos, greedy), "
        f"streamed /v1/completions, {runs} run(s) a set-up; logs in {logs}\n"
    )
    base = "one process" if "one process" in names else names[0]
    ceiling = "engine alone" if "engine alone" in names else None
    print(
        "| streams | set-up | output tok/s (median) | runs | TTFT p50 (ms) | CPU per token (ms) "
        f"| / {base} | / engine alone | greedy texts = {names[0]} |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for c in levels:
        for name in names:
            level = results[name, c]
            rate = statistics.median(level.tokens_per_s)
            spread = " / ".join(f"{x:,.0f}" for x in level.tokens_per_s)
            of_ceiling = "—"
            if ceiling is not None:
                of_ceiling = f"{paired_ratio(level, results[ceiling, c]):.2f}x"
            equal = level.texts == results[names[0], c].texts
            if not equal:
                problems.append(f"{name}, {c} streams: greedy texts differ from {names[0]}'s")
            print(
                f"| {c} | {name} | {rate:,.0f} | {spread} | "
                f"{_ms(statistics.median(level.ttft_p50_ms))} | "
                f"{statistics.median(level.cpu_ms_per_token):.2f} | "
                f"{paired_ratio(level, results[base, c]):.2f}x | {of_ceiling} | "
                f"{'yes' if equal else 'NO'} |"
            )
    for problem in problems[:40]:
        print(f"PROBLEM: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
