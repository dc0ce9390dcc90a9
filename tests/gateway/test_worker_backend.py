"""``sluice serve --worker grpc://...`` in front of real ``sluice worker`` processes: the
official SDK streams the in-process engine's text through gateway and worker (tool calls
too), a client that goes away aborts the request on its worker (blocks freed), requests are
placed by the workers' reported loads, a worker that dies ends its streams with an error,
and with none left a request is a 503 with ``Retry-After``, never a hang."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import torch
from openai import OpenAI
from safetensors.torch import save_file

from sluice.engine.models.gpt2 import GPT2Config, GPT2LMHeadModel
from sluice.engine.tokenizer import Tokenizer
from sluice.vllm_grpc.proto import method_path
from sluice.vllm_grpc.proto import vllm_engine_pb2 as pb
from tests.engine.tool_model import ARGUMENTS, PREAMBLE, TOOL_NAME, write_tool_model
from tests.server import ServerProcess
from tests.tiny_tokenizer import train_tokenizer
from tests.worker_process import WorkerProcess

# Worker processes load torch and a model: slow to start on a busy 2-core machine.
pytestmark = pytest.mark.timeout(240)

CHAT = [{"role": "user", "content": "What does socket.connect do?"}]
CORPUS = ["Streams of tokens arrive one by one, and the reader takes them as they come."] * 30
# The long model's context: thousands of tokens keep a request running through a test.
LONG_POSITIONS = 2048


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random GPT-2 of 2,048 positions (its text means nothing; it runs long)."""
    directory = tmp_path_factory.mktemp("long") / "long-test"
    directory.mkdir()
    train_tokenizer(directory / "tokenizer.json", CORPUS)
    vocab_size = Tokenizer.from_file(directory / "tokenizer.json").vocab_size
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=vocab_size, n_positions=LONG_POSITIONS, n_embd=32, n_layer=2, n_head=4
    )
    model = GPT2LMHeadModel(config)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(directory / "model.safetensors"))
    hf_config = {"model_type": "gpt2", "activation_function": "gelu_new", **vars(config)}
    (directory / "config.json").write_text(json.dumps(hf_config))
    return directory


def gateway(*workers: WorkerProcess, options: tuple[str, ...] = ()) -> ServerProcess:
    flags = [flag for worker in workers for flag in ("--worker", worker.url)]
    return ServerProcess("--no-model", *flags, *options)


def worker_load(worker: WorkerProcess) -> pb.SchedulerLoad:
    """The worker's own report, asked directly."""
    with grpc.insecure_channel(worker.target) as channel:
        get_loads = channel.unary_unary(
            method_path("GetLoads"),
            request_serializer=pb.GetLoadsRequest.SerializeToString,
            response_deserializer=pb.GetLoadsResponse.FromString,
        )
        response: pb.GetLoadsResponse = get_loads(pb.GetLoadsRequest(), timeout=30)
        return response.loads[0]


def engine_stats(server: ServerProcess, model: str) -> dict[str, int]:
    engines: dict[str, dict[str, int]] = httpx.get(f"{server.base_url}/readyz", timeout=30).json()[
        "engines"
    ]
    return engines[model]


def wait_for_stats(server: ServerProcess, model: str, **expected: int) -> dict[str, int]:
    """Poll ``/readyz`` until the model's stats show ``expected`` (10 s at most)."""
    deadline = time.monotonic() + 10
    stats: dict[str, int] = {}
    while time.monotonic() < deadline:
        stats = engine_stats(server, model)
        if all(stats.get(name) == value for name, value in expected.items()):
            return stats
        time.sleep(0.02)  # polling an observable condition with a deadline
    raise AssertionError(f"never {expected}: {stats}")


def streamed_text(client: OpenAI, model: str, **options: object) -> tuple[str, str | None, int]:
    """A streamed chat's text, finish reason and completion tokens."""
    text, reason, completion_tokens = "", None, 0
    for chunk in client.chat.completions.create(
        model=model,
        messages=CHAT,  # type: ignore[arg-type]
        stream=True,
        stream_options={"include_usage": True},
        **options,  # type: ignore[call-overload]
    ):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
        if chunk.usage is not None:
            completion_tokens = chunk.usage.completion_tokens
    return text, reason, completion_tokens


@pytest.fixture(scope="module")
def tiny_worker() -> Iterator[WorkerProcess]:
    """A worker of the bundled model."""
    with WorkerProcess("--kv-blocks", "64") as process:
        yield process


@pytest.fixture(scope="module")
def front(tiny_worker: WorkerProcess) -> Iterator[ServerProcess]:
    """A gateway in front of it."""
    with gateway(tiny_worker) as server:
        yield server.wait_ready()


@pytest.fixture(scope="module")
def engine() -> Iterator[ServerProcess]:
    """The bundled model in the gateway's own engine, for comparison."""
    with ServerProcess("--kv-blocks", "64") as server:
        yield server.wait_ready()


def test_the_sdk_streams_the_in_process_engines_greedy_text(
    front: ServerProcess, engine: ServerProcess
) -> None:
    remote = OpenAI(base_url=f"{front.base_url}/v1", api_key="unused")
    local = OpenAI(base_url=f"{engine.base_url}/v1", api_key="unused")
    assert next(m.id for m in remote.models.list()) == "sluice-tiny"
    options = {"max_tokens": 32, "temperature": 0}
    expected = streamed_text(local, "sluice-tiny", **options)
    assert expected[0].strip()
    assert streamed_text(remote, "sluice-tiny", **options) == expected
    # A stop string cuts the same text at the same place, on both.
    stop = expected[0].split()[2]
    expected = streamed_text(local, "sluice-tiny", stop=[stop], **options)
    assert expected[1] == "stop"
    assert streamed_text(remote, "sluice-tiny", stop=[stop], **options) == expected
    whole = remote.chat.completions.create(
        model="sluice-tiny",
        messages=CHAT,  # type: ignore[arg-type]
        max_tokens=32,
        temperature=0,
    )
    assert whole.choices[0].message.content == streamed_text(local, "sluice-tiny", **options)[0]


def test_the_native_api_reads_a_worker_stream_like_any_other(front: ServerProcess) -> None:
    body = {"prompt": "Return the number of", "max_tokens": 5, "ignore_eos": True}
    created = httpx.post(f"{front.base_url}/v1/streams", json=body, timeout=30).json()
    assert created["model"] == "sluice-tiny"
    raw = httpx.get(f"{front.base_url}{created['events_url']}", timeout=30).text
    assert "event: usage" in raw
    assert '"completion_tokens":5' in raw
    assert raw.rstrip().endswith('data: {"reason":"length"}')


@pytest.fixture(scope="module")
def workers(long_model: Path) -> Iterator[tuple[WorkerProcess, WorkerProcess]]:
    """Two workers of a model that runs long."""
    options = ("--model", str(long_model), "--kv-blocks", "256")
    with WorkerProcess(*options) as first, WorkerProcess(*options) as second:
        yield first, second


@pytest.fixture(scope="module")
def two_front(workers: tuple[WorkerProcess, WorkerProcess]) -> Iterator[ServerProcess]:
    """A gateway in front of both."""
    with gateway(*workers) as server:
        yield server.wait_ready()


def open_stream(stack: contextlib.ExitStack, front: ServerProcess) -> Iterator[str]:
    """Start a long chat and read its first chunk: it is running on a worker. The stream
    stays open while ``stack`` is and the lines returned are referenced (the iterator
    closes the response when it is collected)."""
    body = {
        "model": "long-test",
        "messages": CHAT,
        "stream": True,
        "max_tokens": LONG_POSITIONS - 64,
        "ignore_eos": True,
    }
    response = stack.enter_context(
        httpx.stream("POST", f"{front.base_url}/v1/chat/completions", json=body, timeout=30)
    )
    assert response.status_code == 200
    lines = response.iter_lines()
    first = next_data(lines)
    assert '"error"' not in first, first
    return lines


def next_data(lines: Iterator[str]) -> str:
    """The next ``data:`` line of an SSE response."""
    return next(line for line in lines if line.startswith("data:"))


def test_a_client_that_goes_away_aborts_on_the_worker(two_front: ServerProcess) -> None:
    front = two_front
    with contextlib.ExitStack() as stack:
        held = open_stream(stack, front)
        busy = engine_stats(front, "long-test")
        assert busy["running"] + busy["waiting"] == 1, busy
        assert busy["kv_blocks_used"] > 0, busy
        assert next_data(held)  # still streaming
    # The connection closed mid-stream: the worker's engine frees the blocks.
    idle = wait_for_stats(front, "long-test", running=0, waiting=0, kv_blocks_used=0)
    assert idle["workers_up"] == 2
    metrics = httpx.get(f"{front.base_url}/metrics", timeout=30).text
    freed = [
        line
        for line in metrics.splitlines()
        if line.startswith('sluice_cancel_to_kv_free_seconds_count{model="long-test"')
    ]
    assert freed
    assert float(freed[0].rpartition(" ")[2]) >= 1


def test_requests_go_to_the_least_loaded_worker(
    two_front: ServerProcess, workers: tuple[WorkerProcess, WorkerProcess]
) -> None:
    front = two_front
    first, second = workers
    with contextlib.ExitStack() as stack:  # idle workers: one each
        held = [open_stream(stack, front), open_stream(stack, front)]
        assert worker_load(first).num_total_reqs == 1
        assert worker_load(second).num_total_reqs == 1
        assert all(next_data(lines) for lines in held)
    wait_for_stats(front, "long-test", running=0, waiting=0, kv_blocks_used=0)
    # Load the first worker from outside the gateway (another gateway, say).
    with grpc.insecure_channel(first.target) as channel, contextlib.ExitStack() as stack:
        generate = channel.unary_stream(
            method_path("Generate"),
            request_serializer=pb.GenerateRequest.SerializeToString,
            response_deserializer=pb.GenerateResponse.FromString,
        )
        for n in range(2):
            request = pb.GenerateRequest(
                request_id=f"outside-{n}",
                tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]),
                sampling_params=pb.SamplingParams(max_tokens=LONG_POSITIONS - 8, ignore_eos=True),
                stream=True,
            )
            call = generate(request, timeout=60)
            stack.callback(call.cancel)
            next(call)
        # Once the gateway has seen the report, both of its streams go to the second.
        wait_for_stats(front, "long-test", running=2, waiting=0)
        held = [open_stream(stack, front), open_stream(stack, front)]
        assert worker_load(second).num_total_reqs == 2
        assert worker_load(first).num_total_reqs == 2
        assert all(next_data(lines) for lines in held)  # still streaming
    wait_for_stats(front, "long-test", running=0, waiting=0, kv_blocks_used=0)


def test_a_streams_deadline_aborts_it_on_the_worker(
    workers: tuple[WorkerProcess, WorkerProcess],
) -> None:
    """A second gateway over the same workers, whose streams last a second at most: the
    stream ends ``length`` at its deadline and the worker's engine lets go of it."""
    with gateway(*workers, options=("--max-stream-duration", "1")) as front:
        front.wait_ready()
        client = OpenAI(base_url=f"{front.base_url}/v1", api_key="unused", max_retries=0)
        _, reason, tokens = streamed_text(
            client, "long-test", max_tokens=LONG_POSITIONS - 64, extra_body={"ignore_eos": True}
        )
        assert reason == "length"
        assert 0 < tokens < LONG_POSITIONS - 64
        wait_for_stats(front, "long-test", running=0, waiting=0, kv_blocks_used=0)


def test_a_dead_worker_ends_its_streams_is_left_and_none_left_is_a_503(
    long_model: Path,
) -> None:
    options = ("--model", str(long_model), "--kv-blocks", "256")
    with (
        WorkerProcess(*options) as first,
        WorkerProcess(*options) as second,
        gateway(first, second) as front,
        contextlib.ExitStack() as stack,
    ):
        front.wait_ready()
        lines = open_stream(stack, front)
        serving, other = (first, second) if worker_load(first).num_total_reqs else (second, first)
        serving.kill()
        # The stream ends with a retryable error, never with [DONE], and does not hang.
        rest = [line for line in lines if line.startswith("data:")]
        assert '"error"' in rest[-1]
        assert "data: [DONE]" not in rest
        client = OpenAI(base_url=f"{front.base_url}/v1", api_key="unused", max_retries=0)
        for _ in range(3):  # placed on the worker left, whatever the gateway knew
            _, reason, tokens = streamed_text(
                client, "long-test", max_tokens=4, extra_body={"ignore_eos": True}
            )
            assert (reason, tokens) == ("length", 4)
        other.kill()
        body = {"model": "long-test", "messages": CHAT, "stream": True}
        response = httpx.post(f"{front.base_url}/v1/chat/completions", json=body, timeout=30)
        assert response.status_code == 503
        assert int(response.headers["retry-after"]) >= 1
        assert "no worker" in response.json()["error"]["message"]
        assert wait_for_stats(front, "long-test", workers_up=0)["workers"] == 2


def test_a_worker_model_calls_tools_as_the_embedded_engine_does(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A Llama with a Hermes-style template: the template and its tools travel from the
    worker (GetTokenizer), the gateway renders them and reads the call in the answer."""
    directory = write_tool_model(tmp_path_factory.mktemp("tools") / "hermes-tiny")
    with (
        WorkerProcess("--model", str(directory), "--kv-blocks", "64") as worker,
        gateway(worker) as front,
    ):
        front.wait_ready()
        client = OpenAI(base_url=f"{front.base_url}/v1", api_key="unused", max_retries=0)
        tools: list[Any] = [
            {
                "type": "function",
                "function": {
                    "name": TOOL_NAME,
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                },
            }
        ]
        question: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
        chunks = list(
            client.chat.completions.create(
                model="hermes-tiny", messages=question, tools=tools, temperature=0, stream=True
            )
        )
        choices = [chunk.choices[0] for chunk in chunks if chunk.choices]
        assert "".join(choice.delta.content or "" for choice in choices) == PREAMBLE
        calls = [call for choice in choices for call in choice.delta.tool_calls or ()]
        assert calls[0].function is not None
        assert calls[0].function.name == TOOL_NAME
        arguments = "".join(c.function.arguments or "" for c in calls if c.function is not None)
        assert json.loads(arguments) == ARGUMENTS
        assert choices[-1].finish_reason == "tool_calls"
