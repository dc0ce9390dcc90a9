"""The saturation curve of ``sluice serve`` with the bundled model, admission on and off.

Two fresh servers, the same except for admission: "on" runs with ``--ttft-slo SLO`` (a
request whose predicted time to first token is over the SLO is refused with 503 +
``Retry-After`` before its response starts), "off" queues everything the engine's waiting
queue holds. ``sluice bench`` (closed loop, OpenAI Completions, streaming) loads each at
every concurrency level for ``--duration`` seconds, and the table lists, per level: TTFT
p50/p99 of accepted requests, output tokens/s, and how many were served and refused.

The target (issue 5): with admission on, TTFT p99 of accepted requests stays under the SLO
at every load; with it off, the collapse shows.

Problems (exit status 1): requests that failed with an error (not a refusal), a load
generator that did not finish, a server that had to be killed or logged a traceback. A
p99 over the SLO is a missed target, printed, not a problem.

    .venv/bin/python bench/saturation.py                       # ~5 min
    .venv/bin/python bench/saturation.py --levels 1,8,64 --duration 5   # quicker
    .venv/bin/python bench/saturation.py --quick               # smoke run, ~1 min
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from peers import BENCH_DIR, HOST, ServerProcess, free_port, scan_log

TINY_MODEL = BENCH_DIR.parent / "models" / "sluice-tiny"  # the bundled model, not the default

# --quick: two levels, one below and one well past the engine's 64 running sequences.
QUICK_LEVELS, QUICK_DURATION_S = "1,96", 3.0


def serve_command(port: int, *options: str) -> list[str]:
    return [
        sys.executable, "-m", "sluice.cli", "serve", "--host", HOST, "--port", str(port),
        "--log-level", "warning", "--model", str(TINY_MODEL), *options,
    ]  # fmt: skip


def load(port: int, args: argparse.Namespace, out: Path) -> list[dict[str, object]] | None:
    """``sluice bench`` against ``port``; its levels, or None when it did not finish."""
    command = [
        sys.executable, "-m", "sluice.cli", "bench", "--url", f"http://{HOST}:{port}",
        "--api", "openai-completions", "--concurrency", args.levels,
        "--duration", str(args.duration), "--max-tokens", str(args.max_tokens),
        "--prompt-tokens", str(args.prompt_tokens), "--temperature", "0",
        "--no-progress", "--json", str(out),
    ]  # fmt: skip
    levels_s = len(args.levels.split(","))
    try:
        subprocess.run(
            command,
            check=False,
            stdout=subprocess.DEVNULL,
            timeout=60 + 3 * levels_s * args.duration,
        )
        levels: list[dict[str, object]] = json.loads(out.read_text())["levels"]
    except (subprocess.TimeoutExpired, OSError, ValueError, KeyError):
        return None
    return levels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="1,4,16,64,128,256", help="concurrency levels")
    parser.add_argument("--duration", type=float, default=15.0, help="seconds per level")
    parser.add_argument("--slo", type=float, default=1.0, help="TTFT SLO with admission on")
    parser.add_argument(
        "--headroom",
        type=float,
        default=0.3,
        help="of the SLO, kept for the way from the server's engine to the client (--ttft-headroom)",
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: levels {QUICK_LEVELS}, {QUICK_DURATION_S:g} s each",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.levels, args.duration = QUICK_LEVELS, QUICK_DURATION_S

    logs = Path(tempfile.mkdtemp(prefix="saturation-"))
    results: dict[str, list[dict[str, object]]] = {}
    problems: list[str] = []
    on = ["--ttft-slo", str(args.slo), "--ttft-headroom", str(args.headroom)]
    for name, options in (("on", on), ("off", [])):
        port = free_port()
        server = ServerProcess(
            name, serve_command(port, *options), port, "/readyz", logs / f"{name}.log"
        )
        try:
            server.start(ready_timeout=60)
        except RuntimeError as exc:
            problems.append(f"admission {name}: {exc}")
            continue
        with server:
            levels = load(port, args, logs / f"{name}.json")
        if levels is None:
            problems.append(f"admission {name}: sluice bench did not finish (see {logs})")
        else:
            results[name] = levels
        if server.exit_note:
            problems.append(f"admission {name}: server {server.exit_note}")
        problems += [f"admission {name} log: {line}" for line in scan_log(server.log_path)]
        print(f"admission {name}: done", flush=True)

    def ms(value: object) -> str:
        return "-" if value is None else f"{float(str(value)):.0f}"

    print(
        f"\nTTFT SLO with admission on: {args.slo:g} s ({args.headroom:g} s of it headroom); "
        f"{args.duration:g} s per level\n"
    )
    print(
        "| concurrency | admission | TTFT p50 (ms) | TTFT p99 (ms) | output tok/s | "
        "served | refused | errors | p99 within SLO |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    missed = 0
    for level_on, level_off in zip(results.get("on", []), results.get("off", []), strict=False):
        for name, level in (("on", level_on), ("off", level_off)):
            if level["num_errors"]:
                problems.append(
                    f"admission {name}, {level['level']:g} streams: {level['num_errors']} "
                    f"requests failed: {level['errors']}"
                )
            ttft = level["ttft_ms"]
            assert isinstance(ttft, dict)
            p99 = ttft["p99"]
            within = p99 is not None and float(p99) <= args.slo * 1000
            if name == "on" and not within and level["num_ok"]:
                missed += 1
            print(
                f"| {level['level']:g} | {name} | {ms(ttft['p50'])} | {ms(p99)} | "
                f"{float(str(level['output_tokens_per_s'])):.0f} | {level['num_ok']} | "
                f"{level['num_refused']} | {level['num_errors']} | "
                f"{'yes' if within else 'no'} |"
            )
    print(f"\nadmission on: TTFT p99 over the SLO at {missed} level(s); logs in {logs}")
    if problems:
        print("\nProblems:\n" + "\n".join(f"- {p}" for p in problems))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
