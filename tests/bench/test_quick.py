"""Every benchmark of ``bench/`` in its ``--quick`` mode, as a user runs it, so none rots.

Each test runs ``python bench/<name>.py --quick`` in its own process group and asserts it
exited 0: a benchmark exits 1 when its run reports a problem (client errors, streams not
held, a server that had to be killed or logged a traceback, a crash), not when it misses
a performance target (those are printed PASS/MISS). Its table is printed (``pytest -s``
or ``-rP`` shows it), and shown in full when the test fails.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
# How long a quick run may take on a busy 2-vCPU machine (each takes well under a minute
# alone); the process group is stopped at this bound, and pytest-timeout stops the test
# a minute later if even that hangs.
RUN_LIMIT_S = 420


def run_quick(name: str) -> str:
    """Run ``bench/<name>.py --quick``; its output, or fail with it."""
    process = subprocess.Popen(
        [sys.executable, str(BENCH_DIR / f"{name}.py"), "--quick"],
        cwd=BENCH_DIR.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its servers too: one group to stop
    )
    try:
        output, _ = process.communicate(timeout=RUN_LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            output, _ = process.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
        pytest.fail(f"bench/{name}.py --quick ran past {RUN_LIMIT_S} s:\n{output}")
    print(output)
    assert process.returncode == 0, f"bench/{name}.py --quick: exit {process.returncode}\n{output}"
    return output


pytestmark = [pytest.mark.bench, pytest.mark.timeout(RUN_LIMIT_S + 60)]


def table_row(output: str, prefix: str) -> list[str]:
    """The cells of the markdown row of ``output`` that starts with ``prefix``."""
    for line in output.splitlines():
        if line.startswith(prefix):
            return [cell.strip() for cell in line.strip().strip("|").split("|")]
    pytest.fail(f"no row starting {prefix!r} in:\n{output}")


def test_sse_fanout_quick_run_holds_every_stream_and_delivers_every_engine_token() -> None:
    output = run_quick("sse_fanout")
    assert "| **throughput**" in output
    assert "| **concurrency**" in output
    assert "| **latency**" in output
    assert "| **engine**" in output
    # Exit 0 already means none missing or duplicated; the row shows both servers counted.
    delivered = table_row(output, "| tokens delivered (of N x K produced) |")
    assert delivered[1] == delivered[2] != "—", delivered


def test_fanout_floor_quick_run_counts_every_token_of_the_floor_sluice_and_sse_starlette() -> None:
    output = run_quick("fanout_floor")
    # Exit 0 already means no token missing or doubled on any of the three servers.
    for server in ("floor", "sluice", "sse-starlette"):
        assert table_row(output, f"| 50 (2,500) | {server} |")[2] != "—"
    assert "One `send` of a token frame on loopback here" in output


def test_engine_throughput_quick_run_matches_transformers_greedy_output() -> None:
    output = run_quick("engine_throughput")
    assert "| ours / HF static batch |" in output


def test_proxy_overhead_quick_run_delivers_every_token_direct_through_sluice_and_litellm() -> None:
    output = run_quick("proxy_overhead")
    # direct | Sluice hop | added | LiteLLM hop | added: every hop measured.
    latency = table_row(output, "| 8 | token latency p50 (ms) |")
    assert "—" not in latency[2:7], latency
    cpu = table_row(output, "| 8 | Sluice CPU / LiteLLM CPU per token |")
    assert cpu[3] != "—", cpu


def test_saturation_quick_run_serves_or_refuses_every_request_with_admission_on_and_off() -> None:
    output = run_quick("saturation")
    assert "| 96 | on |" in output
    assert "| 96 | off |" in output


def test_probe_quick_run_finds_no_attack_that_succeeds() -> None:
    output = run_quick("probe")
    assert "| attack | outcome | figure | verdict |" in output


def test_transports_quick_run_delivers_every_token_on_every_transport() -> None:
    output = run_quick("transports")
    header = table_row(output, "| metric |")
    assert header[1:] == ["sse-h1", "sse-h2", "websocket", "long-poll", "grpc"]
    # Exit 0 already means no token lost or doubled; the row says so for each transport.
    lost = table_row(output, "| tokens lost, doubled or failed streams (all levels) |")
    assert lost[1:] == ["0"] * 5, lost


def test_worker_quick_run_streams_the_same_greedy_text_in_process_and_through_a_worker() -> None:
    output = run_quick("worker")
    assert table_row(output, "| 8 | greedy texts equal |")[3] == "yes"
    cpu = table_row(output, "| 8 | server CPU per token (ms) |")
    assert "nan" not in cpu[2:4], cpu


def test_scaleout_quick_compares_the_redis_log_with_the_memory_log() -> None:
    output = run_quick("scaleout")
    rounds = table_row(output, "| round trips per step")
    assert float(rounds[2]) <= 1.5  # the step's appends share a round trip
    assert table_row(output, "| resume on another replica")[4] in ("PASS", "MISS")


def test_speculative_quick_run_keeps_greedy_output_identical_in_every_row() -> None:
    output = run_quick("speculative")
    # Exit 0 already means no greedy row differs (between modes, or from transformers).
    assert "- greedy output identical in every row: PASS" in output
    assert table_row(output, "| sluice-tiny | 0 | 1 | draft |")[5].endswith("x")


def test_served_throughput_quick_run_streams_the_same_greedy_text_in_every_set_up() -> None:
    output = run_quick("served_throughput")
    # Exit 0 already means every request got all its tokens and no greedy text differs.
    for level in ("1", "8"):
        setups = (
            "engine alone",
            "one process",
            "two processes",
            "--engine-process",
            "--engine-replicas 2",
        )
        for setup in (*setups, "HF static batch"):
            row = table_row(output, f"| {level} | {setup} |")
            assert float(row[2].replace(",", "")) > 0, row
            assert row[6].endswith("x"), row  # / one process
            assert row[8].endswith("x"), row  # / HF static batch
            assert row[-1] == "yes", row  # greedy texts equal, transformers' too
    hf_target = table_row(output, "| 64 concurrent >= 1.5x HF static batch | --engine-process")
    assert hf_target[3] == "n/a: 64 streams not run"  # --quick runs 1 and 8
