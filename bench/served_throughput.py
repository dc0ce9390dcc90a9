"""Served output tokens/s of ``sluice-tiny``: Sluice's set-ups and the serving peers'.

The workload of the engine peers' serving rows (``../shared/reports/engine_peers.md``, there
driven by ``vllm bench serve``): 128-token prompts, 128 output tokens with ``ignore_eos``,
greedy, streamed ``POST /v1/completions``, a closed loop of C concurrent requests (2 x C
requests a level, at least 8), with an aiohttp client as vLLM's bench uses
(``served_client``). Set-ups, all
serving ``models/sluice-tiny`` on 127.0.0.1 and each started once:

- **engine alone** (the ceiling): the same prompts straight into ``AsyncEngine`` in a
  child process of the bench, no HTTP, with the torch threads ``sluice serve`` gives it;
- **one process**: ``sluice serve --model models/sluice-tiny --no-engine-process``: HTTP,
  SSE and the engine's thread share one interpreter and its GIL;
- **two processes**: ``sluice worker --model models/sluice-tiny`` and ``sluice serve
  --no-model --worker grpc://...`` in front of it, started by hand;
- **--engine-process**: ``sluice serve --model models/sluice-tiny --engine-process``: the
  same split, made by ``sluice serve`` itself (``sluice.engine_process``);
- **--engine-replicas 2**: ``sluice serve --model models/sluice-tiny --engine-replicas 2``:
  two engine processes of half the cache and the cores' threads each, as one
  (``sluice.engine_process.replicas``);
- **HF static batch** (unless ``--no-hf``): ``transformers``' ``generate`` over the same
  prompt ids in a child process, C at a time as one static batch, fp32 on every core, no
  HTTP: the reference of the issue's third served target (64 streams served >= 1.5x it);
- with ``--peers vllm,llama.cpp``, the servers users would pick instead (``served_peers``,
  installed by ``scripts/install_peers.sh``; one that is not is reported, not run): **vLLM
  serve** (vLLM CPU's OpenAI server, fp32, 2 threads) and **llama-server** (llama.cpp's,
  the f32 GGUF, 2 threads, 64 slots, continuous batching), driven by the same client with the
  same requests. Sluice takes text prompts only, so every server gets the same text, and each
  peer's ``/tokenize`` must give Sluice's 128 ids for every prompt (a problem otherwise).

The set-ups take turns, run after run (in reverse order every other run), so that a change
in the machine's load falls on all of them, and each measurement first waits (at most
``--quiet-wait`` s) for the machine's other jobs to go quiet. Every run has prompts of its own, so that no
server's prefix cache (Sluice's is always on, llama-server's by default) holds a prompt from
an earlier run. Every request is checked: 128 prompt tokens and ``max_tokens`` output tokens
by the server's usage (or, without one, its text chunks). Reported per set-up and level
(``served_report``): median output tokens/s of the runs (and each run's), TTFT p50, the
server side's CPU per output token (every process of the set-up, from /proc), the other
jobs' cores on the machine meanwhile, and the ratios to one process, to the engine alone,
to the HF static batch and to each peer: the median over runs of the ratio within a run; the
issue's three served targets, PASS/MISS (n/a for a peer not run). Exit status 1 when a
request failed or fell short, when a greedy text differs between Sluice's set-ups, or when
a server logged trouble; a peer's greedy differences (the HF static batch's too) are
listed, and figures are printed, never a failure.

Run: ``python bench/served_throughput.py [--quick] [--runs N] [--levels 1,64] [--peers
vllm,llama.cpp] [--no-hf]`` (``--quick``: levels 1 and 8, 32 output tokens, one run; about a
minute).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import orjson
from tokenizers import Tokenizer

import served_peers
from engine_peers.launcher import PEERS_DIR, parse_peer_names, wait_for_quiet
from engine_peers.protocol import ForeignCpu
from peers import HOST, ServerProcess, WorkerChild, free_port, process_cpu_s, scan_log
from served_client import MODEL, PROMPT_TOKENS, closed_loop, make_prompts
from served_report import ENGINE_ALONE, HF_STATIC, REPLICAS, Level, render

REPO = Path(__file__).resolve().parents[1]
SETUPS = (ENGINE_ALONE, "one process", "two processes", "--engine-process", REPLICAS)
ONE_PROCESS_OPTIONS = ("--no-engine-process",)
# Prompts: a run's at C streams come from seed C + RUN_SEED_STEP x (run + 1), the warm-up's
# from WARM_UP_SEED, so no server has seen a prompt before (random.seed(-n) is seed(n)).
WARM_UP_SEED = 0
RUN_SEED_STEP = 1_000
# Other jobs share the machine's cores, and a server whose threads spin (llama.cpp's, vLLM's
# OpenMP threads) loses far more than its share to them: each measurement waits (this long at
# most) for them to go quiet, as bench/engine_throughput.py does, and the report shows the
# other jobs' cores during it.
DEFAULT_QUIET_WAIT_S = 30.0
MAX_PROBLEMS_PRINTED = 40


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
    peer: str | None = None  # the --peers name of a serving peer's set-up


def serve_options(name: str, engine_threads: int | None) -> list[str]:
    """``sluice serve``'s options for the one-process, ``--engine-process`` or replicas
    set-up."""
    options = ["--model", str(MODEL)]
    if name == REPLICAS:
        options += ["--engine-process", *REPLICAS.split()]
    else:
        options += ["--engine-process"] if name == "--engine-process" else [*ONE_PROCESS_OPTIONS]
    if engine_threads is not None:
        options += ["--engine-threads", str(engine_threads)]
    return options


def start_setup(
    name: str, logs: Path, stack: contextlib.ExitStack, engine_threads: int | None = None
) -> Setup:
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
    else:
        options = serve_options(name, engine_threads)
    command = serve_command(port, *options)
    server = ServerProcess(name, command, port, "/readyz", log, ready_timeout_s=240, cwd=REPO)
    stack.enter_context(server)
    pids.append(server.pid)
    return Setup(name, f"http://{HOST}:{port}", pids, paths)


def start_peer(name: str, logs: Path, stack: contextlib.ExitStack, peers_dir: Path) -> Setup | str:
    """The serving peer ``name``, started, or why it is not (not installed, did not start)."""
    server = served_peers.locate(name, free_port(), peers_dir)
    if isinstance(server, str):
        return server
    log = logs / f"{name}.log"
    try:
        process = stack.enter_context(served_peers.start(server, log))
    except RuntimeError as exc:
        return f"did not start: {exc}"
    return Setup(server.label, f"http://{HOST}:{server.port}", [process.pid], [log], peer=name)


def engine_alone(concurrency: int, max_tokens: int, seed: int) -> None:
    """The ceiling: the same requests straight into the engine (``AsyncEngine``, as ``sluice
    serve`` builds it, its threads tuned as its ``--engine-threads auto`` default does in
    the engine's child process), no HTTP. Runs in a child process (``--engine-alone C K
    SEED``); prints its figures as JSON."""
    import torch

    from sluice.engine.driver import AsyncEngine
    from sluice.engine.loader import load_checkpoint
    from sluice.engine.sampling_params import SamplingParams
    from sluice.engine.threads import cores_but_one, tuned_threads

    torch.set_num_threads(cores_but_one())
    checkpoint = load_checkpoint(MODEL)
    prompts = [
        checkpoint.tokenizer.encode(p)
        for p in make_prompts(max(8, 2 * concurrency), PROMPT_TOKENS, seed=seed)
    ]
    params = SamplingParams(max_tokens, temperature=0, ignore_eos=True)

    async def run() -> dict[str, object]:
        engine = checkpoint.engine(num_blocks=1024, max_num_seqs=64)
        engine.threads = tuned_threads()
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


def hf_static(concurrency: int, max_tokens: int, seed: int) -> None:
    """The issue's in-process reference: ``transformers``' ``generate`` over the same
    prompts, ``concurrency`` at a time as one static batch (``bench/engine_throughput.py``'s
    HF static batch), fp32, greedy, every token made, on every core. Runs in a child
    process (``--hf-static C K SEED``); prints its figures as JSON."""
    import os

    import torch

    from engine_throughput import hf_generate, load_hf
    from sluice.engine.loader import load_checkpoint

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    tokenizer = load_checkpoint(MODEL).tokenizer
    prompts = [
        tokenizer.encode(p) for p in make_prompts(max(8, 2 * concurrency), PROMPT_TOKENS, seed=seed)
    ]
    model, pad_id = load_hf(MODEL), tokenizer.eos_token_id or 0
    hf_generate(model, prompts[:2], 4, pad_id)  # warm-up
    completions: list[list[int]] = []
    cpu_before = time.process_time()
    started = time.perf_counter()
    for first in range(0, len(prompts), concurrency):
        completions += hf_generate(model, prompts[first : first + concurrency], max_tokens, pad_id)
    wall_s = time.perf_counter() - started
    cpu_s = time.process_time() - cpu_before
    texts = [
        b"".join(tokenizer.token_bytes(t) for t in ids).decode("utf-8", "replace")
        for ids in completions
    ]
    tokens = sum(len(ids) for ids in completions)
    result = {"tokens": tokens, "wall_s": wall_s, "cpu_s": cpu_s, "texts": texts}
    sys.stdout.write(orjson.dumps(result).decode() + "\n")


# The set-ups timed in a child process of the bench, no HTTP: their flags there.
CHILD_SETUPS = {ENGINE_ALONE: "--engine-alone", HF_STATIC: "--hf-static"}


def measure_alone(name: str, level: Level, concurrency: int, max_tokens: int, seed: int,
                  problems: list[str]) -> None:  # fmt: skip
    command = [sys.executable, __file__, CHILD_SETUPS[name]]
    command += [str(concurrency), str(max_tokens), str(seed)]
    foreign, started, child_cpu_s = ForeignCpu(), time.monotonic(), _reaped_children_cpu_s()
    done = subprocess.run(command, capture_output=True, cwd=REPO, timeout=600, check=False)
    # ForeignCpu counts a child that has exited as foreign: take the engine's CPU back out.
    child_cores = (_reaped_children_cpu_s() - child_cpu_s) / (time.monotonic() - started)
    if done.returncode != 0:
        problems.append(f"{name}: exit {done.returncode}: {done.stderr.decode()[-400:]}")
        level.num_short += 1
        return
    result = orjson.loads(done.stdout.splitlines()[-1])
    level.tokens_per_s.append(result["tokens"] / result["wall_s"])
    level.ttft_p50_ms.append(float("nan"))
    level.cpu_ms_per_token.append(result["cpu_s"] * 1000 / max(1, result["tokens"]))
    level.other_cores.append(max(0.0, _cores(foreign) - child_cores))
    if not level.texts:
        level.texts = result["texts"]
    if result["tokens"] != max_tokens * len(result["texts"]):
        problems.append(f"{name}, {concurrency} streams: {result['tokens']} tokens")
        level.num_short += 1


def measure(setup: Setup, level: Level, prompts: list[str], concurrency: int, max_tokens: int,
            problems: list[str]) -> None:  # fmt: skip
    foreign = ForeignCpu()  # the machine's CPU outside this bench's processes
    cpu_before = sum(process_cpu_s(pid) for pid in setup.pids)
    samples, wall_s = asyncio.run(closed_loop(setup.base, prompts, concurrency, max_tokens))
    cpu_s = sum(process_cpu_s(pid) for pid in setup.pids) - cpu_before
    level.other_cores.append(_cores(foreign))
    num_tokens = sum(s.num_tokens for s in samples)
    level.tokens_per_s.append(num_tokens / wall_s)
    ttfts = [s.ttft_s for s in samples if s.ttft_s is not None]
    level.ttft_p50_ms.append(statistics.median(ttfts) * 1000 if ttfts else float("nan"))
    level.cpu_ms_per_token.append(cpu_s * 1000 / max(1, num_tokens))
    if not level.texts:
        level.texts = [s.text for s in samples]
    for i, sample in enumerate(samples):
        where = f"{setup.name}, {concurrency} streams, request {i}"
        if sample.error or sample.num_tokens != max_tokens:
            level.num_short += 1
            problems.append(
                f"{where}: {sample.num_tokens} tokens of {max_tokens}"
                f"{', ' + sample.error if sample.error else ''}"
            )
        if sample.prompt_tokens not in (None, PROMPT_TOKENS):
            problems.append(f"{where}: {sample.prompt_tokens} prompt tokens by its usage")


def _reaped_children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _cores(foreign: ForeignCpu) -> float:
    cores = foreign.cores()
    return float("nan") if cores is None else cores


def check_tokens(setup: Setup, peer: str, prompts: list[str], ids: list[list[int]],
                 problems: list[str]) -> None:  # fmt: skip
    """That the peer ``peer`` makes Sluice's token ids of every prompt (outside the timed
    window)."""
    for index, (prompt, wanted) in enumerate(zip(prompts, ids, strict=True)):
        try:
            theirs = served_peers.tokenize(peer, setup.base, prompt)
        except (OSError, ValueError, KeyError) as exc:
            problems.append(f"{setup.name}: /tokenize failed: {type(exc).__name__}: {exc}")
            return
        if theirs != wanted:
            problems.append(
                f"{setup.name}: prompt {index} is {len(theirs)} token ids there, Sluice's "
                f"{len(wanted)}, not the same"
            )


def print_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="levels 1 and 8, 32 tokens, 1 run")
    parser.add_argument("--runs", type=int, default=None, help="runs per set-up (default 3)")
    parser.add_argument("--levels", default=None, help="concurrencies (default 1,64)")
    parser.add_argument(
        "--setups",
        default=",".join(SETUPS),
        help=f"comma-separated, of: {', '.join(SETUPS)} (greedy texts are checked against the first)",
    )
    parser.add_argument(
        "--peers",
        default="",
        help="serving peers to run beside, comma-separated: vllm, llama.cpp "
        "(scripts/install_peers.sh installs them)",
    )
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=None,
        help="seconds to wait, at most, before each measurement for the other jobs on the "
        "machine to go quiet (default 30; 0 with --quick)",
    )
    parser.add_argument(
        "--engine-threads",
        type=int,
        default=None,
        help="sluice serve's --engine-threads for the one-process and --engine-process "
        "set-ups (default: its own, the cores but one)",
    )
    parser.add_argument("--peers-dir", type=Path, default=PEERS_DIR, help=argparse.SUPPRESS)
    parser.add_argument(
        "--hf",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"time {HF_STATIC} too: transformers' generate in-process, the issue's "
        "reference at 64 streams (default: yes)",
    )
    parser.add_argument("--engine-alone", nargs=3, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--hf-static", nargs=3, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.engine_alone or args.hf_static:
        return args
    args.levels = [int(c) for c in args.levels.split(",")] if args.levels else None
    args.levels = args.levels or ([1, 8] if args.quick else [1, 64])
    args.runs = args.runs or (1 if args.quick else 3)
    args.max_tokens = 32 if args.quick else 128
    if args.quiet_wait is None:
        args.quiet_wait = 0.0 if args.quick else DEFAULT_QUIET_WAIT_S
    args.setups = [name.strip() for name in args.setups.split(",")]
    unknown = sorted(set(args.setups) - set(SETUPS))
    if unknown:
        parser.error(f"unknown set-ups: {unknown}")
    try:
        args.peers = parse_peer_names(args.peers)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.engine_alone:
        engine_alone(*args.engine_alone)
        return 0
    if args.hf_static:
        hf_static(*args.hf_static)
        return 0
    levels, runs, max_tokens, names = args.levels, args.runs, args.max_tokens, args.setups
    seeds = {(run, c): c + RUN_SEED_STEP * (run + 1) for run in range(runs) for c in levels}
    prompts = {
        key: make_prompts(max(8, 2 * key[1]), PROMPT_TOKENS, seed) for key, seed in seeds.items()
    }
    tokenizer = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    ids = {key: [tokenizer.encode(p).ids for p in texts] for key, texts in prompts.items()}
    warm_up = make_prompts(max(levels), PROMPT_TOKENS, seed=WARM_UP_SEED)
    logs = Path(tempfile.mkdtemp(prefix="bench-served-"))
    problems: list[str] = []
    missing: dict[str, str] = {}  # peer set-up -> why it did not run (not installed: no problem)
    with contextlib.ExitStack() as stack:
        setups = [
            start_setup(name, logs, stack, args.engine_threads)
            for name in names
            if name != ENGINE_ALONE
        ]
        for peer in args.peers:
            started = start_peer(peer, logs, stack, args.peers_dir)
            if isinstance(started, Setup):
                setups.append(started)
                continue
            missing[served_peers.LABELS[peer]] = started
            if not started.startswith(served_peers.NOT_INSTALLED):  # installed, did not start
                problems.append(f"{served_peers.LABELS[peer]}: {started}")
        peers = [*([HF_STATIC] if args.hf else []), *(setup.name for setup in setups if setup.peer)]
        results = {(name, c): Level() for name in [*names, *peers] for c in levels}
        for setup in setups:  # warm-up: the first requests' one-time costs, at every batch size
            asyncio.run(closed_loop(setup.base, warm_up, max(levels), 8))
        for run in range(runs):
            for c in levels:
                turn: list[Setup | str] = [*([ENGINE_ALONE] if ENGINE_ALONE in names else [])]
                turn += [*([HF_STATIC] if args.hf else []), *setups]
                for setup in turn if run % 2 == 0 else turn[::-1]:
                    if args.quiet_wait > 0:
                        what = f"{setup if isinstance(setup, str) else setup.name}, {c} streams"
                        wait_for_quiet(args.quiet_wait, what, log=print_stderr)
                    if isinstance(setup, str):
                        level = results[setup, c]
                        measure_alone(setup, level, c, max_tokens, seeds[run, c], problems)
                        continue
                    if setup.peer:
                        check_tokens(setup, setup.peer, prompts[run, c], ids[run, c], problems)
                    measure(setup, results[setup.name, c], prompts[run, c], c, max_tokens, problems)
        served_bytes = {path: path.stat().st_size for setup in setups for path in setup.logs}
    for setup in setups:
        for path in setup.logs:
            if setup.peer:  # what it logged while serving (not how it stopped)
                found = served_peers.scan_peer_log(path, served_bytes[path])
            else:
                found = scan_log(path)
            problems += [f"{path.name}: {line}" for line in found]
    print(
        f"sluice-tiny, {PROMPT_TOKENS} prompt + {max_tokens} output tokens (ignore_eos, greedy), "
        f"streamed /v1/completions, {runs} run(s) a set-up, {os.cpu_count()} CPUs, up to "
        f"{args.quiet_wait:.0f} s a measurement waiting for quiet; logs in {logs}\n"
    )
    report = render(results, [*names, *peers], levels, peers, missing)
    print("\n".join(report.lines))
    problems += report.problems
    if report.notes:
        print("\nGreedy texts of the peers that differ from Sluice's (not a failure):")
        print("\n".join(f"- {note}" for note in report.notes))
    for problem in problems[:MAX_PROBLEMS_PRINTED]:
        print(f"PROBLEM: {problem}")
    if len(problems) > MAX_PROBLEMS_PRINTED:
        print(f"PROBLEM: ... and {len(problems) - MAX_PROBLEMS_PRINTED} more")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
