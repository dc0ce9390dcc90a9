"""``bench/served_throughput.py``'s parts with no serving peer installed: a missing peer is a
stated reason, a peer that does not start is a stated failure, the client counts what a
server really streamed, and the report's paired ratios, targets and greedy comparison. The
real peers need ``scripts/install_peers.sh`` and run in ``served_throughput.py --peers``."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import importlib
import math
import sys
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
# The benchmarks import each other as top-level modules, run from bench/.
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))

served_client = importlib.import_module("served_client")
served_peers = importlib.import_module("served_peers")
served_report = importlib.import_module("served_report")
served_throughput = importlib.import_module("served_throughput")

Level = served_report.Level


def test_peer_without_its_server_is_reported_not_installed(tmp_path: Path) -> None:
    for name in ("vllm", "llama.cpp"):
        reason = served_peers.locate(name, 8000, tmp_path)
        assert isinstance(reason, str)
        assert reason.startswith(served_peers.NOT_INSTALLED)


def test_peer_without_its_model_copy_is_reported_not_installed(tmp_path: Path) -> None:
    server = tmp_path / "llama-build" / "bin" / "llama-server"
    server.parent.mkdir(parents=True)
    server.write_text("#!/bin/sh\n")
    reason = served_peers.locate("llama.cpp", 8000, tmp_path)
    assert reason == f"{served_peers.NOT_INSTALLED}: no sluice-tiny-f32.gguf"


def test_llama_server_is_served_with_64_slots_of_256_tokens_on_2_threads(tmp_path: Path) -> None:
    server = tmp_path / "llama-build" / "bin" / "llama-server"
    server.parent.mkdir(parents=True)
    server.write_text("#!/bin/sh\n")
    (tmp_path / "sluice-tiny-f32.gguf").write_text("weights")
    found = served_peers.locate("llama.cpp", 8123, tmp_path)
    assert isinstance(found, served_peers.PeerServer)
    assert found.label == "llama-server"
    flags = " ".join(found.command[1:])
    for flag in ("--port 8123", "-t 2 -tb 2", "-np 64", "-c 16384", "--cont-batching"):
        assert flag in flags
    assert found.env["OMP_NUM_THREADS"] == "2"


def test_vllm_serve_is_fp32_without_prefix_caching_bound_to_2_cores(tmp_path: Path) -> None:
    server = tmp_path / "vllm" / "bin" / "vllm-cpu-serve"
    server.parent.mkdir(parents=True)
    server.write_text("#!/bin/sh\n")
    (tmp_path / "sluice-tiny-hf").mkdir()
    found = served_peers.locate("vllm", 8124, tmp_path)
    assert isinstance(found, served_peers.PeerServer)
    flags = " ".join(found.command[1:])
    for flag in ("--dtype float32", "--max-num-seqs 64", "--no-enable-prefix-caching"):
        assert flag in flags
    assert found.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"


def test_unknown_peer_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"llama\.cpp"):
        served_peers.locate("tgi", 8000)
    with pytest.raises(SystemExit):
        served_throughput.parse_args(["--peers", "vllm,tgi"])


def test_peers_are_parsed_and_quick_keeps_its_sizes() -> None:
    args = served_throughput.parse_args(["--quick", "--peers", "vllm, llama.cpp"])
    assert args.peers == ["vllm", "llama.cpp"]
    assert (args.levels, args.runs, args.max_tokens, args.quiet_wait) == ([1, 8], 1, 32, 0)
    assert served_throughput.parse_args([]).peers == []


def test_engine_threads_reach_the_sluice_serve_set_ups_only() -> None:
    assert served_throughput.parse_args([]).engine_threads is None
    assert served_throughput.parse_args(["--engine-threads", "2"]).engine_threads == 2
    options = served_throughput.serve_options("--engine-process", 2)
    assert options[-2:] == ["--engine-threads", "2"]
    assert "--engine-threads" not in served_throughput.serve_options("one process", None)
    replicas = served_throughput.serve_options("--engine-replicas 2", 1)
    assert replicas[2:] == ["--engine-process", "--engine-replicas", "2", "--engine-threads", "1"]


def test_missing_peer_is_a_reason_and_starts_nothing(tmp_path: Path) -> None:
    with contextlib.ExitStack() as stack:
        started = served_throughput.start_peer("vllm", tmp_path, stack, tmp_path / "none")
    assert isinstance(started, str)
    assert started.startswith(served_peers.NOT_INSTALLED)


def test_peer_that_exits_at_start_is_a_stated_failure(tmp_path: Path) -> None:
    server = tmp_path / "peers" / "llama-build" / "bin" / "llama-server"
    server.parent.mkdir(parents=True)
    server.write_text("#!/bin/sh\necho 'cannot load model' >&2\nexit 3\n")
    server.chmod(0o755)
    (tmp_path / "peers" / "sluice-tiny-f32.gguf").write_text("weights")
    with contextlib.ExitStack() as stack:
        started = served_throughput.start_peer("llama.cpp", tmp_path, stack, tmp_path / "peers")
    assert isinstance(started, str)
    assert started.startswith("did not start: llama-server exited with 3")
    assert "cannot load model" in (tmp_path / "llama.cpp.log").read_text()


def test_peer_log_trouble_is_errors_not_warnings(tmp_path: Path) -> None:
    log = tmp_path / "peer.log"
    log.write_text(
        "(APIServer pid=1) WARNING 12-03 [cpu.py:224] Triton is not installed.\n"
        "0.00.057.127 W llama_context: n_ctx_seq (512) > n_ctx_train (256)\n"
        "0.01.000.000 E slot update_slots: failed to decode\n"
        "(EngineCore pid=2) ERROR 12-03 [core.py:1] EngineCore failed\n"
    )
    lines = log.read_text().splitlines()
    assert served_peers.scan_peer_log(log) == lines[2:]


def test_peer_log_after_it_was_stopped_is_not_scanned(tmp_path: Path) -> None:
    log = tmp_path / "peer.log"
    log.write_text("(APIServer pid=1) INFO 12-03 [launcher.py:195] Route: /health\n")
    served_bytes = log.stat().st_size
    with log.open("a") as tail:
        tail.write("(APIServer pid=1) ERROR 12-03 [async_llm.py:906] EngineDeadError\n")
    assert served_peers.scan_peer_log(log, served_bytes) == []
    assert len(served_peers.scan_peer_log(log)) == 1


def sse(chunks: list[dict[str, Any]]) -> bytes:
    body = b"".join(b"data: " + orjson.dumps(chunk) + b"\n\n" for chunk in chunks)
    return body + b"data: [DONE]\n\n"


def serve_once_and_request(body: bytes, max_tokens: int) -> Any:
    """One streamed completion from a server on 127.0.0.1 that answers ``body``."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
        await reader.readexactly(length)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        await writer.drain()
        writer.close()

    async def scenario() -> Any:
        listener = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = listener.sockets[0].getsockname()[1]
        async with listener:
            samples, _ = await served_client.closed_loop(
                f"http://127.0.0.1:{port}", ["a prompt"], 1, max_tokens
            )
        return samples[0]

    return asyncio.run(scenario())


def text_chunk(text: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "text": text, "finish_reason": None}]}


def test_server_without_usage_is_counted_by_its_text_chunks() -> None:
    sample = serve_once_and_request(sse([text_chunk("a"), text_chunk(""), text_chunk(" b")]), 4)
    assert (sample.num_tokens, sample.text, sample.prompt_tokens) == (2, "a b", None)


def test_usage_counts_the_tokens_and_the_prompt_it_saw() -> None:
    usage = {"choices": [], "usage": {"prompt_tokens": 128, "completion_tokens": 3}}
    sample = serve_once_and_request(sse([text_chunk("a"), text_chunk("b"), usage]), 3)
    assert (sample.num_tokens, sample.num_chunks, sample.prompt_tokens) == (3, 2, 128)
    assert sample.ttft_s is not None


def level(rates: list[float], texts: list[str] | None = None, num_short: int = 0) -> Any:
    runs = len(rates)
    return Level(
        tokens_per_s=rates,
        ttft_p50_ms=[10.0] * runs,
        cpu_ms_per_token=[1.0] * runs,
        other_cores=[0.1] * runs,
        texts=texts if texts is not None else ["x", "y"],
        num_short=num_short,
    )


def test_ratio_is_the_median_of_the_ratios_within_each_run() -> None:
    ours, theirs = level([100.0, 300.0, 50.0]), level([100.0, 100.0, 100.0])
    # Within-run ratios 1.0, 3.0, 0.5: median 1.0. Against 200, 100, 10 they are 0.5, 3.0,
    # 5.0: median 3.0, where the ratio of the medians would be 100 / 100 = 1.0.
    assert served_report.paired_ratio(ours, theirs) == 1.0
    assert served_report.paired_ratio(ours, level([200.0, 100.0, 10.0])) == 3.0
    assert math.isnan(served_report.paired_ratio(ours, level([1.0, 1.0, 1.0], num_short=1)))


def results_of(**rates: list[float]) -> tuple[dict[tuple[str, int], Any], list[str]]:
    names = {"one": "one process", "split": "--engine-process", "vllm": "vLLM serve"}
    names |= {"llama": "llama-server", "hf": "HF static batch"}
    results = {}
    for key, values in rates.items():
        c = 64 if key.endswith("64") else 1
        results[names[key.rsplit("_", 1)[0]], c] = level(values)
    return results, ["one process", "--engine-process"]


def target_rows(lines: list[str]) -> list[list[str]]:
    rows = [line for line in lines if line.startswith("| 1 at a time") or "concurrent >=" in line]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def test_targets_are_judged_for_the_default_and_the_best_set_up() -> None:
    results, sluice = results_of(
        one_1=[300.0], split_1=[400.0], llama_1=[1000.0],
        one_64=[900.0], split_64=[1200.0], vllm_64=[1000.0], vllm_1=[200.0], llama_64=[1.0],
    )  # fmt: skip
    peers = ["vLLM serve", "llama-server"]
    report = served_report.render(results, [*sluice, *peers], [1, 64], peers)
    assert target_rows(report.lines) == [
        ["64 concurrent >= 1.0x vLLM serve", "--engine-process (default)", "1.20x", "**PASS**"],
        ["64 concurrent >= 1.0x vLLM serve", "--engine-process (best at 64)", "1.20x", "**PASS**"],
        ["1 at a time >= 0.5x llama-server", "--engine-process (default)", "0.40x", "**MISS**"],
        ["1 at a time >= 0.5x llama-server", "--engine-process (best at 1)", "0.40x", "**MISS**"],
        *[["64 concurrent >= 1.5x HF static batch", f"{s} ({r})", "—", "n/a: HF static batch not run"]
          for s, r in (("--engine-process", "default"), ("--engine-process", "best at 64"))],
    ]  # fmt: skip
    assert report.problems == []
    assert report.notes == []


def test_the_hf_static_batch_target_is_judged_at_64_streams() -> None:
    results, sluice = results_of(
        one_64=[1200.0, 1100.0], split_64=[1600.0, 1500.0], hf_64=[1000.0, 1000.0],
    )  # fmt: skip
    names = [*sluice, "HF static batch"]
    report = served_report.render(results, names, [64], ["HF static batch"])
    hf_rows = [row for row in target_rows(report.lines) if "HF static batch" in row[0]]
    assert hf_rows == [
        ["64 concurrent >= 1.5x HF static batch", "--engine-process (default)", "1.55x", "**PASS**"],
        ["64 concurrent >= 1.5x HF static batch", "--engine-process (best at 64)", "1.55x", "**PASS**"],
    ]  # fmt: skip
    results["one process", 64] = level([1500.0, 1600.0])  # 1.5x and 1.6x: 1.55x
    results["--engine-process", 64] = level([1400.0, 1480.0])  # 1.4x and 1.48x: 1.44x
    report = served_report.render(results, names, [64], ["HF static batch"])
    verdicts = [row[1:] for row in target_rows(report.lines) if "HF static batch" in row[0]]
    assert verdicts == [
        ["--engine-process (default)", "1.44x", "**MISS**"],
        ["one process (best at 64)", "1.55x", "**PASS**"],
    ]


def test_verdict_made_while_the_machine_was_busy_says_so() -> None:
    results, _ = results_of(split_1=[300.0], llama_1=[500.0])
    results["llama-server", 1].other_cores = [0.93]
    names = ["--engine-process", "llama-server"]
    report = served_report.render(results, names, [1], ["llama-server"])
    verdicts = [row[3] for row in target_rows(report.lines)]
    assert verdicts[2:4] == ["**PASS** (machine busy: other jobs 0.93 cores)"] * 2


def test_missing_or_short_peer_gets_no_figure_and_no_verdict() -> None:
    results, _ = results_of(split_1=[300.0], split_64=[900.0], llama_1=[9.0], llama_64=[9.0])
    results["llama-server", 1].num_short = 2
    missing = {"vLLM serve": "not installed (run scripts/install_peers.sh)"}
    report = served_report.render(results, ["--engine-process", "llama-server"], [1, 64],
                                  ["llama-server"], missing)  # fmt: skip
    verdicts = [row[3] for row in target_rows(report.lines)]
    assert verdicts[:2] == ["n/a: vLLM serve not installed (run scripts/install_peers.sh)"] * 2
    assert verdicts[2:4] == ["n/a: llama-server stopped short"] * 2
    assert "| 1 | llama-server | — (2 short) |" in "\n".join(report.lines)
    text = "\n".join(report.lines)
    assert "PASS" not in text
    assert "MISS" not in text


def test_peer_greedy_difference_is_a_note_and_sluice_one_a_problem() -> None:
    results, _ = results_of(one_1=[300.0], split_1=[300.0], llama_1=[900.0])
    results["llama-server", 1].texts = ["x", "yz"]
    results["--engine-process", 1].texts = ["x", "q"]
    names = ["one process", "--engine-process", "llama-server"]
    report = served_report.render(results, names, [1], ["llama-server"])
    assert report.notes == ["llama-server, 1 streams: request 1 differs from character 1 on"]
    assert report.problems == [
        "--engine-process, 1 streams: greedy texts differ from one process's"
    ]
    assert "| 1 of 2 |" in "\n".join(report.lines)


def test_text_differences_name_where_each_text_first_differs() -> None:
    same, differences = served_report.text_differences(["abc", "abd", "ab"], ["abc", "abc", "abc"])
    assert same == 1
    assert differences == [
        "request 1 differs from character 2 on",
        "request 2 differs from character 2 on",
    ]


class _TokenizeHandler(http.server.BaseHTTPRequestHandler):
    """llama-server's ``/tokenize``, answering [1, 2, 3] whatever it is sent."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        body = orjson.dumps({"tokens": [1, 2, 3]})
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_peer_that_tokenizes_a_prompt_otherwise_is_a_problem() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _TokenizeHandler)
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        setup = served_throughput.Setup("llama-server", base, [], [], peer="llama.cpp")
        problems: list[str] = []
        served_throughput.check_tokens(
            setup, "llama.cpp", ["same", "other"], [[1, 2, 3], [1, 2, 4]], problems
        )
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    assert problems == ["llama-server: prompt 1 is 3 token ids there, Sluice's 3, not the same"]
