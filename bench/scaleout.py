"""What sharing streams through Redis costs: the Redis event log against the memory log.

Peer: Sluice's own in-process :class:`~sluice.streams.memory.MemoryEventLog`, in the same
run, with the same load. The load is engine-shaped: one step every 20 ms appends one token
to every one of N live streams (as the engine's step does), each stream has one reader
waiting on the log, and a token's delivery latency is from the step's start to its reader
waking with it. The Redis log sends each step's appends as one pipeline (one round trip per
step, not per token), so the figures show what that costs per token.

Rows:

- ``delivery p50/p99`` per token at N streams, memory vs Redis (the reader on the replica
  that runs the stream), and for a reader on another replica (its mirror fed by pub/sub);
  target: Redis adds at most 1 ms p50 and 5 ms p99;
- ``CPU per token`` of this process (the replica) over the run; target: at most 2x the
  memory log's; Redis's own CPU is shown beside it (from ``INFO cpu``);
- ``resume on another replica``: a replica that never saw a stream attaches to it (loads its
  retained events) and reads from a position; target p99 at most 50 ms;
- ``events/s one Redis sustains``: appends from 1,000 streams as fast as the writer sends.

``--quick`` runs 100 streams for 1 s. Exits 1 on a problem (a token lost or out of order,
a run that failed), not on a missed target (printed MISS).

    .venv/bin/python bench/scaleout.py            # 1,000 streams, ~1 min
    .venv/bin/python bench/scaleout.py --quick    # ~15 s
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import redis.asyncio as aioredis

from sluice.events import Finished, FinishReason, TextDelta
from sluice.streams.log import EventLog, LogLimits
from sluice.streams.memory import MemoryEventLog
from sluice.streams.redis_client import open_redis
from sluice.streams.redis_log import RedisEventLog

STEP_S = 0.020


@contextmanager
def redis_server() -> Iterator[str]:
    executable = shutil.which("redis-server")
    if executable is None:
        raise SystemExit("redis-server is missing: run scripts/setup.sh --test")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as directory:
        command = [executable, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        command += ["--appendonly", "no", "--dir", directory]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert process.stdout is not None
        for line in process.stdout:
            if b"Ready to accept connections" in line:
                break
        drain = subprocess.Popen(["cat"], stdin=process.stdout, stdout=subprocess.DEVNULL)
        try:
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            process.terminate()
            process.wait()
            drain.wait()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def redis_cpu_s(client: aioredis.Redis) -> float:
    info = await client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


async def deliver(
    writer: EventLog, readers_log: EventLog, num_streams: int, num_steps: int, problems: list[str]
) -> tuple[list[float], float, int]:
    """Step ``num_steps`` times; return every token's delivery latency (s), this process's
    CPU seconds, and the tokens delivered. ``readers_log`` is where the readers wait (the
    writer itself, or another replica's log that follows the streams)."""
    ids = [f"str_bench{n:017d}" for n in range(num_streams)]
    for stream_id in ids:
        await writer.create(stream_id)
    if readers_log is not writer:
        assert isinstance(readers_log, RedisEventLog)
        await writer.append(ids[0], [TextDelta("warm")])  # keys exist before following
        for stream_id in ids:
            await readers_log.follow(stream_id)
    latencies: list[float] = []
    step_started = [0.0]
    loop = asyncio.get_running_loop()

    async def read(stream_id: str) -> int:
        seen = readers_log.last_seq(stream_id)
        count = 0
        while True:
            waiter: asyncio.Future[None] = loop.create_future()
            readers_log.watch(stream_id, seen, waiter)
            await waiter
            latency = time.perf_counter() - step_started[0]
            batch = readers_log.read(stream_id, seen, 100)
            for event in batch.events:
                if isinstance(event, Finished):
                    return count
                count += 1
                latencies.append(latency)
            seen = batch.last_seq

    tasks = [asyncio.create_task(read(stream_id)) for stream_id in ids]
    await asyncio.sleep(0)
    cpu_before = time.process_time()
    next_step = loop.time()
    for step in range(num_steps):
        next_step += STEP_S
        step_started[0] = time.perf_counter()
        token = [TextDelta(f" t{step}")]
        # As the hub's producer appends tokens: without waiting for Redis to store them
        # (readers are woken once it has).
        await asyncio.gather(*(writer.append(i, token, wait=False) for i in ids))
        await asyncio.sleep(max(0.0, next_step - loop.time()))
    await asyncio.gather(*(writer.append(i, [Finished(FinishReason.STOP)]) for i in ids))
    counts = await asyncio.wait_for(asyncio.gather(*tasks), 30)
    cpu_s = time.process_time() - cpu_before
    if any(count != num_steps for count in counts):
        problems.append(f"tokens lost: expected {num_steps} per stream, got {set(counts)}")
    for stream_id in ids:
        await writer.delete(stream_id)
        if readers_log is not writer:
            await readers_log.delete(stream_id)
    return latencies, cpu_s, sum(counts)


async def resume_elsewhere(url: str, num_resumes: int) -> list[float]:
    """A stream of 100 events in Redis; another replica attaches and reads from event 50."""
    client_a, client_b = open_redis(url), open_redis(url)
    a, b = RedisEventLog(client_a), RedisEventLog(client_b)
    times: list[float] = []
    async with a.running(), b.running():
        for n in range(num_resumes):
            stream_id = f"str_resume{n:016d}"
            await a.create(stream_id)
            await a.append(stream_id, [TextDelta(f" w{i}") for i in range(99)])
            await a.append(stream_id, [Finished(FinishReason.STOP)])
            started = time.perf_counter()
            await b.follow(stream_id)
            batch = b.read(stream_id, 50, 100)
            times.append(time.perf_counter() - started)
            assert len(batch.events) == 50
            b.unfollow(stream_id)
            await a.delete(stream_id)
    await client_a.aclose()
    await client_b.aclose()
    return times


async def throughput(url: str, num_streams: int, duration_s: float) -> float:
    client = open_redis(url)
    log = RedisEventLog(client, LogLimits(max_records=1_000))
    num_events = 0
    async with log.running():
        ids = [f"str_tput{n:018d}" for n in range(num_streams)]
        for stream_id in ids:
            await log.create(stream_id)
        deadline = time.perf_counter() + duration_s
        started = time.perf_counter()

        async def produce(stream_id: str) -> int:
            count = 0
            while time.perf_counter() < deadline:
                await log.append(stream_id, [TextDelta(" x")])
                count += 1
            return count

        num_events = sum(await asyncio.gather(*(produce(i) for i in ids)))
        elapsed = time.perf_counter() - started
        for stream_id in ids:
            await log.delete(stream_id)
    await client.aclose()
    return num_events / elapsed


async def xadd_floor(url: str, num_streams: int, num_steps: int) -> tuple[float, list[float]]:
    """The floor of one pipelined write per step: each step's appends as bare ``XADD``s
    (no script, no counters, no publish) in one pipeline, a step every 20 ms. Returns
    Redis's own CPU per step (s: what every token of the step waits for at the least,
    since its reader wakes with the step's reply) and each step's round trip (s)."""
    client = open_redis(url)
    keys = [f"sluice:{{str_floor{n:016d}}}:log" for n in range(num_streams)]
    payload = b'["t"," t0"]'
    round_trips: list[float] = []
    loop = asyncio.get_running_loop()
    before = await redis_cpu_s(client)
    next_step = loop.time()
    for _ in range(num_steps):
        next_step += STEP_S
        started = time.perf_counter()
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.xadd(key, {"e": payload}, maxlen=1000, approximate=True)
        await pipe.execute()
        round_trips.append(time.perf_counter() - started)
        await asyncio.sleep(max(0.0, next_step - loop.time()))
    used = await redis_cpu_s(client) - before
    await client.delete(*keys)
    await client.aclose()
    return used / num_steps, round_trips


async def main(args: argparse.Namespace) -> int:
    num_streams = 100 if args.quick else args.streams
    num_steps = 50 if args.quick else args.steps
    problems: list[str] = []
    rows: list[tuple[str, str, str, str, str]] = []
    with redis_server() as url:
        memory = MemoryEventLog()
        mem_lat, mem_cpu, mem_tokens = await deliver(
            memory, memory, num_streams, num_steps, problems
        )
        client = open_redis(url)
        other = open_redis(url)
        redis_before = await redis_cpu_s(client)
        log = RedisEventLog(client)
        async with log.running():
            red_lat, red_cpu, red_tokens = await deliver(log, log, num_streams, num_steps, problems)
            redis_used = await redis_cpu_s(client) - redis_before
            round_trips = log.num_round_trips
            replica = RedisEventLog(other)
            async with replica.running():
                far_lat, _, _ = await deliver(log, replica, num_streams, num_steps, problems)
        await client.aclose()
        await other.aclose()
        resumes = await resume_elsewhere(url, 20 if args.quick else 200)
        events_per_s = await throughput(
            url, num_streams if args.quick else 1000, 1.0 if args.quick else 5.0
        )
        floor_redis_s, floor_trips = await xadd_floor(url, num_streams, 20 if args.quick else 100)

    def ms(values: list[float], q: float) -> float:
        return percentile(values, q) * 1000

    added_p50 = ms(red_lat, 0.5) - ms(mem_lat, 0.5)
    added_p99 = ms(red_lat, 0.99) - ms(mem_lat, 0.99)
    mem_us = mem_cpu / max(1, mem_tokens) * 1e6
    red_us = red_cpu / max(1, red_tokens) * 1e6

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "MISS"

    rows.append(
        (
            f"delivery p50, {num_streams} streams",
            f"{ms(mem_lat, 0.5):.2f} ms",
            f"{ms(red_lat, 0.5):.2f} ms",
            f"adds {added_p50:.2f} ms ≤ 1 ms",
            verdict(added_p50 <= 1),
        )
    )
    rows.append(
        (
            f"delivery p99, {num_streams} streams",
            f"{ms(mem_lat, 0.99):.2f} ms",
            f"{ms(red_lat, 0.99):.2f} ms",
            f"adds {added_p99:.2f} ms ≤ 5 ms",
            verdict(added_p99 <= 5),
        )
    )
    rows.append(
        (
            "delivery p50 / p99, reader on another replica",
            "-",
            f"{ms(far_lat, 0.5):.2f} / {ms(far_lat, 0.99):.2f} ms",
            "(pub/sub to a mirror)",
            "-",
        )
    )
    rows.append(
        (
            "replica CPU per token",
            f"{mem_us:.1f} µs",
            f"{red_us:.1f} µs",
            f"{red_us / mem_us:.2f}x ≤ 2x",
            verdict(red_us <= 2 * mem_us),
        )
    )
    rows.append(
        (
            "Redis CPU per token",
            "-",
            f"{redis_used / max(1, red_tokens) * 1e6:.1f} µs",
            "(redis-server)",
            "-",
        )
    )
    rows.append(
        (
            "round trips per step",
            "-",
            f"{round_trips / max(1, num_steps + 1):.2f}",
            "1 pipeline per step",
            "-",
        )
    )
    rows.append(
        (
            "resume on another replica p50 / p99",
            "-",
            f"{ms(resumes, 0.5):.2f} / {ms(resumes, 0.99):.2f} ms",
            "p99 ≤ 50 ms",
            verdict(ms(resumes, 0.99) <= 50),
        )
    )
    rows.append(("events/s one Redis sustains", "-", f"{events_per_s:,.0f}", "(one writer, pipelined)", "-"))  # fmt: skip
    rows.append(
        (
            f"floor: Redis's own time for a step of {num_streams} bare XADDs",
            "-",
            f"{floor_redis_s * 1000:.2f} ms (round trip p50 {ms(floor_trips, 0.5):.2f} ms)",
            "every token of a step waits for it",
            "-",
        )
    )
    print(f"# bench/scaleout.py{' --quick' if args.quick else ''}: Redis log vs memory log")
    load = os.getloadavg()[0]
    print(f"{os.cpu_count()} CPUs, load average {load:.1f}; a step every {STEP_S * 1000:.0f} ms,")
    print(f"{num_steps} steps; latencies include waiting for a CPU on a loaded machine\n")
    print("| measure | memory log | Redis log | target | verdict |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    if problems:
        print("\nProblems:")
        for problem in problems:
            print(f"- {problem}")
        return 1
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="100 streams, 1 s")
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=250)
    sys.exit(asyncio.run(main(parser.parse_args())))
