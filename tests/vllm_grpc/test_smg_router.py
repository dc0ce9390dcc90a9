"""A third-party router of vLLM's gRPC engine protocol in front of ``sluice worker``: the
Shepherd Model Gateway (PyPI ``smg``, ``smg launch --backend vllm --worker-urls grpc://...``)
registers the worker, streams the engine's greedy text, and a client that goes away
mid-stream frees the worker's KV blocks."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from sluice.engine.engine import Engine, EngineConfig
from sluice.engine.loader import load_checkpoint
from sluice.engine.sampling_params import SamplingParams
from sluice.vllm_grpc.proto import method_path
from sluice.vllm_grpc.proto import vllm_engine_pb2 as pb
from tests.server import TEST_MODEL
from tests.worker_process import WorkerProcess

# Worker processes load torch and a model: slow to start on a busy 2-core machine.
pytestmark = pytest.mark.timeout(180)

SMG = Path(sys.executable).with_name("smg")
PROMPT = "Return the number of"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    with WorkerProcess("--kv-blocks", "64") as process:
        yield process


@pytest.fixture(scope="module")
def router(worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``smg launch`` in front of the worker; its base URL once it lists the model."""
    port = free_port()
    log = tmp_path_factory.mktemp("smg") / "smg.log"
    command = [str(SMG), "launch", "--backend", "vllm", "--worker-urls", worker.url]
    command += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warn"]
    with log.open("wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                listed = httpx.get(f"{base}/v1/models", timeout=5).json()
                if [model["id"] for model in listed.get("data", ())] == ["sluice-tiny"]:
                    break
            except httpx.HTTPError:
                pass
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)  # polling an observable condition with a deadline
        yield base
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


def greedy_text(max_tokens: int) -> str:
    """The in-process engine's greedy completion of :data:`PROMPT`."""
    checkpoint = load_checkpoint(TEST_MODEL)
    tokenizer = checkpoint.tokenizer
    config = EngineConfig.for_serving(256, num_blocks=64, max_num_seqs=4)
    engine = Engine(
        checkpoint.model,
        config,
        eos_token_id=tokenizer.eos_token_ids,
        token_bytes=tokenizer.token_bytes,
    )
    engine.add_request(tokenizer.encode(PROMPT), SamplingParams(max_tokens, temperature=0))
    text = ""
    while engine.has_unfinished_requests():
        text += "".join(output.new_text for output in engine.step())
    return text


def worker_load(worker: WorkerProcess) -> pb.SchedulerLoad:
    with grpc.insecure_channel(worker.target) as channel:
        get_loads = channel.unary_unary(
            method_path("GetLoads"),
            request_serializer=pb.GetLoadsRequest.SerializeToString,
            response_deserializer=pb.GetLoadsResponse.FromString,
        )
        response: pb.GetLoadsResponse = get_loads(pb.GetLoadsRequest(), timeout=30)
        return response.loads[0]


def test_smg_streams_the_engines_greedy_text_from_a_sluice_worker(router: str) -> None:
    body = {"model": "sluice-tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    whole = httpx.post(f"{router}/v1/completions", json=body, timeout=60).json()
    expected = greedy_text(12)
    assert whole["choices"][0]["text"] == expected
    assert whole["usage"]["completion_tokens"] == 12
    text = ""
    with httpx.stream(
        "POST", f"{router}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = httpx.Response(200, content=line[6:]).json()
                text += "".join(choice["text"] for choice in chunk["choices"])
    assert text == expected


def test_a_client_leaving_smg_mid_stream_frees_the_workers_blocks(
    router: str, worker: WorkerProcess
) -> None:
    body = {
        "model": "sluice-tiny",
        "prompt": PROMPT,
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{router}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        busy = worker_load(worker)
        assert busy.num_running_reqs + busy.num_waiting_reqs == 1
    deadline = time.monotonic() + 10
    load = worker_load(worker)
    while load.num_running_reqs or load.num_waiting_reqs or load.num_used_tokens:
        assert time.monotonic() < deadline, load
        time.sleep(0.02)  # polling an observable condition with a deadline
        load = worker_load(worker)
