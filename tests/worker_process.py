"""A real ``sluice worker`` process on 127.0.0.1 for tests, and a client of its protocol.

The worker listens on port 0 (a free port the kernel picks, so two tests never race for
one) and prints the port it bound once it serves; :meth:`WorkerProcess.start` reads that
line, so the worker is up when it returns.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Sequence

import grpc

from sluice.vllm_grpc.client import EngineClient
from sluice.vllm_grpc.proto import common_pb2, method_path
from sluice.vllm_grpc.proto import vllm_engine_pb2 as pb
from tests.server import TEST_MODEL, terminate

__all__ = ["EngineCalls", "WorkerProcess", "token_ids", "worker_idle"]


class WorkerProcess:
    """``sluice worker`` with the given options (the bundled model unless ``--model``)."""

    def __init__(self, *options: str) -> None:
        if "--model" not in options:
            options = ("--model", str(TEST_MODEL), *options)
        self.options = options
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"grpc://{self.target}"

    def start(self) -> WorkerProcess:
        command = [
            sys.executable,
            "-m",
            "sluice.cli",
            "worker",
            "--listen",
            "127.0.0.1:0",
            "--log-level",
            "warning",
            *self.options,
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE)
        assert self.process.stdout is not None
        line = self.process.stdout.readline().decode()  # EOF (b"") if it failed to start
        assert line.startswith("Sluice worker"), f"the worker did not start: {line!r}"
        self.port = int(line.rstrip().rpartition(":")[2])
        return self

    def kill(self) -> None:
        """SIGKILL: the worker dies at once, as a crashed host would."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def stop(self) -> int | None:
        process, self.process = self.process, None
        if process is None:
            return None
        code = terminate(process, timeout_s=15)
        if process.stdout is not None:
            process.stdout.close()
        return code

    def __enter__(self) -> WorkerProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class EngineCalls(EngineClient):
    """The gateway's calls of the protocol, and those only the tests make."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        super().__init__(channel)
        self.health_check = channel.unary_unary(
            method_path("HealthCheck"),
            request_serializer=pb.HealthCheckRequest.SerializeToString,
            response_deserializer=pb.HealthCheckResponse.FromString,
        )
        self.get_tokenizer = channel.unary_stream(
            method_path("GetTokenizer"),
            request_serializer=common_pb2.GetTokenizerRequest.SerializeToString,
            response_deserializer=common_pb2.GetTokenizerChunk.FromString,
        )
        self.embed = channel.unary_unary(
            method_path("Embed"),
            request_serializer=pb.EmbedRequest.SerializeToString,
            response_deserializer=pb.EmbedResponse.FromString,
        )


async def worker_idle(calls: EngineCalls) -> pb.SchedulerLoad:
    """Poll ``GetLoads`` until nothing runs, waits or holds a KV block (10 s at most)."""
    deadline = time.monotonic() + 10
    load = pb.SchedulerLoad()
    while time.monotonic() < deadline:
        load = (await calls.get_loads(pb.GetLoadsRequest())).loads[0]
        if load.num_running_reqs == load.num_waiting_reqs == load.num_used_tokens == 0:
            return load
        await asyncio.sleep(0.02)  # polling an observable condition with a deadline
    raise AssertionError(f"the worker still holds the request: {load}")


def token_ids(responses: Sequence[pb.GenerateResponse]) -> list[int]:
    """Every id the chunks of a streamed Generate carried."""
    return [t for r in responses if r.WhichOneof("response") == "chunk" for t in r.chunk.token_ids]
