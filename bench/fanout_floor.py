"""The engine-shaped fan-out against its floor: is ``p99 <= 5 ms at N = 1,000`` reachable here?

``sse_fanout.py --only engine`` measures Sluice and sse-starlette when ONE 20 ms timer gives
each of N streams a token (50 N tokens/s), step-to-client (the step's due time -> the
kernel RX timestamp of the read that carried the token). This benchmark adds the floor
beside them, in the same run and with the same client (ssebench with
``engine_fanout.TokenStream``, every token counted): ``floor_server.py``, a raw uvloop
protocol that does nothing per token but format it and write it to its socket. No Python
server can be faster than that on the same machine, so where the floor misses the target,
the target is a property of the machine (cores, the cost of a ``send``), not of a server.

For each N of ``--streams`` (default 100, 300, 1,000): floor, Sluice
(``engine_server.py``), sse-starlette (``engine_peer.py``), each a fresh process, the
order rotating per repetition; medians over ``--reps``. It also times one ``send`` of a
token-sized frame on a loopback TCP socket here (the syscall and the call around it): the
floor's own cost per token is a few of those.

    .venv/bin/python bench/fanout_floor.py             # ~3 min
    .venv/bin/python bench/fanout_floor.py --quick     # N = 50, one repetition, ~30 s
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engine_fanout import run_engine, tokens_per_stream
from peers import (
    BENCH_DIR,
    ServerProcess,
    engine_baseline_command,
    engine_command,
    free_port,
    scan_log,
)
from sse_fanout import load_ssebench

SERVERS = ("floor", "sluice", "sse-starlette")
TARGET_P99_MS = 5.0
RAMP_ALLOWANCE_S, WARMUP_S, WINDOW_S, DRAIN_S = 5.0, 1.0, 3.0, 30.0


def send_cost_us(samples: int = 2000) -> float:
    """Median time of one ``send`` of a 60-byte frame on a loopback TCP connection whose
    reader (another process) drains it."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    pid = os.fork()
    if pid == 0:  # the reader
        connection, _ = server.accept()
        while connection.recv(1 << 16):
            pass
        os._exit(0)
    client = socket.create_connection(server.getsockname())
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    frame = b"data: 1764751234567890123 123 1764751234567890000 \n\n"
    times = []
    for _ in range(samples):
        started = time.perf_counter_ns()
        client.send(frame)
        times.append(time.perf_counter_ns() - started)
    client.close()
    server.close()
    os.waitpid(pid, 0)
    return statistics.median(times) / 1e3


def command(name: str, port: int) -> tuple[list[str], str, str]:
    """The server's command line, health path and stream path."""
    if name == "floor":
        floor = [sys.executable, str(BENCH_DIR / "floor_server.py"), "--port", str(port)]
        return floor, "/", "/engine?count={k}"
    if name == "sluice":
        ours = engine_command(port, "--retention", "5")
        return ours, "/healthz", "/v1/demo/words?text=tick&max_tokens={k}"
    return engine_baseline_command(port), "/", "/engine?count={k}"


def measure(
    ssebench: Any, name: str, streams: int, num_tokens: int, log_dir: Path
) -> dict[str, Any]:
    port = free_port()
    argv, health, path = command(name, port)
    log = log_dir / f"{name}.log"
    with ServerProcess(name, argv, port, health, log) as server:
        url = f"http://127.0.0.1:{port}" + path.format(k=num_tokens)
        run = run_engine(
            ssebench, url, streams, num_tokens, WARMUP_S, WINDOW_S, DRAIN_S, server.pid
        )
        result: dict[str, Any] = ssebench.uvloop.run(run) if ssebench.uvloop else asyncio.run(run)
    gc.collect()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N = 50, one repetition")
    parser.add_argument("--streams", default="100,300,1000", help="levels of N, comma-separated")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--servers", default=",".join(SERVERS), help=f"comma list of {', '.join(SERVERS)}"
    )
    parser.add_argument("--ssebench-dir", type=Path, default=BENCH_DIR / "ssebench")
    args = parser.parse_args(argv)
    levels = [50] if args.quick else [int(n) for n in args.streams.split(",")]
    reps = 1 if args.quick else args.reps
    servers = tuple(name for name in SERVERS if name in args.servers.split(","))
    if "floor" not in servers:
        parser.error("--servers: the floor is always measured")
    ssebench = load_ssebench(args.ssebench_dir.resolve())
    ssebench.raise_nofile()
    log_dir = Path(tempfile.mkdtemp(prefix="fanout-floor-"))
    num_tokens = tokens_per_stream(RAMP_ALLOWANCE_S, WARMUP_S, WINDOW_S)
    gc.disable()  # as ssebench does
    send_us = send_cost_us()
    results: dict[tuple[str, int], list[dict[str, Any]]] = {}
    problems: list[str] = []
    for n in levels:
        for rep in range(reps):
            order = servers[rep % len(servers) :] + servers[: rep % len(servers)]
            for name in order:
                row = measure(ssebench, name, n, num_tokens, log_dir)
                results.setdefault((name, n), []).append(row)
                lost = row["tokens_missing"] + row["tokens_duplicated"]
                if lost or row["ok_streams"] != n:
                    problems.append(
                        f"{name} N={n} rep {rep + 1}: {row['ok_streams']}/{n} streams, "
                        f"{row['tokens_missing']} tokens missing, "
                        f"{row['tokens_duplicated']} duplicated"
                    )
                print(
                    f"N={n} rep {rep + 1} {name}: p50/p99 {row['e2e_p50_us']}/"
                    f"{row['e2e_p99_us']} us, server CPU {row['server_cpu_pct']}%",
                    file=sys.stderr,
                    flush=True,
                )
    for name in servers:
        problems += [f"{name} log: {line}" for line in scan_log(log_dir / f"{name}.log")]

    def med(name: str, n: int, key: str, scale: float = 1.0) -> str:
        values = [r[key] for r in results[(name, n)] if r.get(key) is not None]
        return f"{statistics.median(values) * scale:,.2f}" if values else "—"

    print(f"\n## Engine-shaped fan-out and its floor (medians of {reps}, one 20 ms timer)\n")
    print(f"One `send` of a token frame on loopback here: {send_us:.1f} µs (median).\n")
    print("| N (tokens/s) | server | step-to-client p50 / p99 (ms) | server CPU (% of 1 core) |")
    print("|---|---|---|---|")
    verdicts = []
    for n in levels:
        for name in servers:
            p50, p99 = med(name, n, "e2e_p50_us", 1e-3), med(name, n, "e2e_p99_us", 1e-3)
            cpu = med(name, n, "server_cpu_pct")
            print(f"| {n:,} ({n * 50:,}) | {name} | {p50} / {p99} | {cpu} |")
        floor_p99 = statistics.median(r["e2e_p99_us"] for r in results[("floor", n)]) / 1e3
        verdicts.append(
            f"- N={n:,}: the floor's p99 is {floor_p99:.2f} ms: the target (<= "
            f"{TARGET_P99_MS:g} ms) is {'within' if floor_p99 <= TARGET_P99_MS else 'beyond'} "
            f"reach of a Python server on this machine"
        )
    print("\n" + "\n".join(verdicts))
    if problems:
        print("\n## Problems\n")
        print("\n".join(f"- {p}" for p in problems))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
