"""Placement over workers, the worker URL, and the tokenizer bundle, with no network: the
pool ranks by the workers' last reports corrected by this gateway's own streams, and the
bundle round-trips the engine's tokenizer and refuses what is not one."""

from __future__ import annotations

import io
import zipfile

import pytest

from sluice.backends.worker_pool import Load, WorkerOptions, WorkerPool
from sluice.engine.loader import load_checkpoint
from sluice.errors import ConfigError
from sluice.vllm_grpc.client import WorkerDescription, parse_worker_url
from sluice.vllm_grpc.proto import vllm_engine_pb2 as pb
from sluice.vllm_grpc.tokenizer_bundle import (
    ModelFiles,
    TokenizerBundleError,
    read_bundle,
    write_bundle,
)
from tests.server import TEST_MODEL


def description(port: int) -> WorkerDescription:
    return WorkerDescription(
        url=f"grpc://127.0.0.1:{port}",
        target=f"127.0.0.1:{port}",
        model="m",
        max_model_len=256,
        eos_token_ids=(0,),
        block_size=16,
        server_type="sluice",
        bundle=b"",
        bundle_sha256="",
    )


def load(num_running: int, num_waiting: int = 0) -> Load:
    return Load(num_running, num_waiting, num_used_tokens=0, max_total_tokens=1024)


def test_idle_workers_take_turns_and_this_gateways_streams_spread_them() -> None:
    pool = WorkerPool([description(1), description(2)], WorkerOptions())
    first, second = pool.workers
    assert {pool.ranked()[0].url for _ in range(4)} == {first.url, second.url}
    first.num_started += 1  # a stream placed there, no report since
    assert pool.ranked()[0] is second
    second.num_started += 2
    assert pool.ranked()[0] is first


def test_a_report_counts_other_gateways_and_this_ones_streams_since() -> None:
    pool = WorkerPool([description(1), description(2)], WorkerOptions())
    first, second = pool.workers
    first.reported(load(3))  # others' load
    second.reported(load(1, 1))
    assert [w.score for w in pool.workers] == [3, 2]
    assert pool.ranked()[0] is second
    second.num_started += 2  # after the report: not in it
    assert second.score == 4
    assert pool.ranked()[0] is first
    second.num_ended += 2
    assert second.score == 2


def test_a_report_that_may_count_a_stream_is_not_added_to_twice() -> None:
    pool = WorkerPool([description(1)], WorkerOptions())
    (worker,) = pool.workers
    worker.num_started += 1  # started while the report was on its way; it counts it
    worker.reported(load(1))
    assert worker.score == 1
    worker.reported(load(0))  # a report from before the stream came in late
    assert worker.score == 1  # at least this gateway's own live streams


def test_down_workers_are_not_ranked() -> None:
    pool = WorkerPool([description(1), description(2)], WorkerOptions())
    first, second = pool.workers
    pool.mark_down(first, "test")
    assert pool.ranked() == [second]
    assert pool.num_up == 1
    pool.mark_down(second, "test")
    assert pool.ranked() == []


def test_load_sums_every_rank_of_a_report() -> None:
    response = pb.GetLoadsResponse(
        loads=[
            pb.SchedulerLoad(num_running_reqs=2, num_used_tokens=32, max_total_num_tokens=512),
            pb.SchedulerLoad(num_waiting_reqs=1, num_used_tokens=16, max_total_num_tokens=512),
        ]
    )
    assert Load.of(response) == Load(2, 1, 48, 1024)


@pytest.mark.parametrize(
    "url", ["http://h:1", "grpc://h", "grpc://:50051", "grpc://h:port", "grpcs://h:1", "h:1"]
)
def test_a_worker_url_must_be_grpc_host_port(url: str) -> None:
    with pytest.raises(ConfigError, match="grpc://HOST:PORT"):
        parse_worker_url(url)


def test_a_worker_url_names_its_target() -> None:
    assert parse_worker_url("grpc://127.0.0.1:50051/") == "127.0.0.1:50051"


def test_options_refuse_what_cannot_work() -> None:
    with pytest.raises(ValueError, match="load_interval_s"):
        WorkerOptions(load_interval_s=0)
    with pytest.raises(ValueError, match="deadline_s"):
        WorkerOptions(deadline_s=-1)


def test_the_bundle_carries_the_engines_tokenizer_and_is_byte_stable() -> None:
    checkpoint = load_checkpoint(TEST_MODEL)
    files = ModelFiles(checkpoint.tokenizer, "{{ messages[0].content }}", "", "<|endoftext|>")
    data = write_bundle(files, 256)
    assert write_bundle(files, 256) == data
    read = read_bundle(data)
    text = "Return the number of items in the sequence, or raise an error."
    assert read.tokenizer.encode(text) == checkpoint.tokenizer.encode(text)
    assert read.tokenizer.eos_token_ids == checkpoint.tokenizer.eos_token_ids
    assert read.chat_template == "{{ messages[0].content }}"
    assert read.eos_token == "<|endoftext|>"
    token = read.tokenizer.encode(text)[3]
    assert read.tokenizer.token_bytes(token) == checkpoint.tokenizer.token_bytes(token)


def zipped(**members: bytes) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"not a zip", "not a ZIP"),
        (zipped(**{"config.json": b"{}"}), "no tokenizer.json"),
        (zipped(**{"tokenizer.json": b"{"}), "tokenizer"),
    ],
)
def test_what_is_not_a_bundle_is_refused(data: bytes, message: str) -> None:
    with pytest.raises(TokenizerBundleError, match=message):
        read_bundle(data)
