"""Large prompts are never encoded on the event loop of a real ``sluice serve``.

Ten 198,000-character prompts arrive at once, on the native API and then as chat messages
on the OpenAI one. Encoding one of them takes about 100 ms of
CPU (timed here with the library call the server once made on its loop), and a server
that encodes on its loop holds every other stream for that long, ten times over. The
bundled model refuses the prompts by their length before encoding them; a checkpoint whose
tokenizer has a normalizer (so no length bound is sound) encodes them on worker threads.
Either way the loop's thread (the server's main thread) spends far less CPU on the ten
prompts than the encodes cost.

Why CPU time and not the latency of a ``/healthz`` probe: on a loaded two-core host (the
test machine runs other suites beside this one) wall-clock latencies swing by hundreds of
milliseconds, while the CPU time a thread spends on given work barely moves. The bound is
half of the ten encodes: a loop that encoded five of them on its own thread fails it, while the
loop's own work on ten 200 KB requests (reading, parsing and rendering them, about 30 ms a
chat request on a loaded host) stays well under it. The encoder releasing the GIL, without which a worker would hold the
loop all the same, is checked in ``tests/backends/test_prompt.py``.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tokenizers

from sluice.cli import BUNDLED_MODEL
from tests.server import ServerProcess

PROMPT = "xq " * 66_000  # 198,000 characters: under the default --max-prompt-chars
NUM_PROMPTS = 10


def encode_cpu_s(tokenizer_path: Path) -> float:
    """CPU seconds the library's plain ``encode`` takes on ``PROMPT`` (the least of 3)."""
    tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_path))
    timings = []
    for _ in range(3):
        started = time.thread_time()
        tokenizer.encode(PROMPT, add_special_tokens=False)
        timings.append(time.thread_time() - started)
    return min(timings)


def loop_cpu_s(server: ServerProcess) -> float:
    """CPU seconds of the server's main thread, which runs its event loop (``/proc``)."""
    assert server.process is not None
    pid = server.process.pid
    with open(f"/proc/{pid}/task/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def send_prompts(server: ServerProcess, api: str, model: str) -> None:
    """Send the prompts at once; each is answered 400 (too long for the context)."""
    if api == "native":
        path, fields = "/v1/streams", {"prompt": PROMPT}
    else:  # a chat: rendered with the template first
        path = "/v1/chat/completions"
        fields = {"model": model, "messages": [{"role": "user", "content": PROMPT}]}
    body = json.dumps({**fields, "max_tokens": 4}).encode()

    def post(_: int) -> httpx.Response:
        headers = {"Content-Type": "application/json"}
        # The encodes queue for two workers; a loaded host makes the last one wait long.
        return httpx.post(f"{server.base_url}{path}", content=body, headers=headers, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(NUM_PROMPTS) as pool:
        responses = list(pool.map(post, range(NUM_PROMPTS)))
    for response in responses:
        assert response.status_code == 400, response.text
        assert "max_model_len" in response.text


def assert_not_encoded_on_the_loop(server: ServerProcess, checkpoint: Path) -> None:
    bound_s = NUM_PROMPTS * encode_cpu_s(checkpoint / "tokenizer.json") / 2
    for api in ("native", "chat"):
        before_s = loop_cpu_s(server)
        send_prompts(server, api, checkpoint.name)
        spent_s = loop_cpu_s(server) - before_s
        assert spent_s < bound_s, (
            f"the event loop spent {spent_s * 1000:.0f} ms of CPU on {NUM_PROMPTS} large "
            f"{api} prompts; bound {bound_s * 1000:.0f} ms"
        )


@pytest.fixture(scope="module")
def normalizing_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled model with an NFC normalizer in its tokenizer: the same tokens for
    ASCII, but no sound bound of a text's tokens from its length, so every prompt is
    encoded."""
    directory = tmp_path_factory.mktemp("nfc") / "sluice-tiny-nfc"
    shutil.copytree(BUNDLED_MODEL, directory)
    path = directory / "tokenizer.json"
    spec = json.loads(path.read_text("utf-8"))
    spec["normalizer"] = {"type": "NFC"}
    path.write_text(json.dumps(spec), "utf-8")
    return directory


@pytest.fixture
def bundled() -> Iterator[ServerProcess]:
    with ServerProcess() as server:
        yield server.wait_ready()


def test_prompts_too_long_for_the_context_are_refused_without_encoding_on_the_loop(
    bundled: ServerProcess,
) -> None:
    assert_not_encoded_on_the_loop(bundled, BUNDLED_MODEL)


def test_large_prompts_are_encoded_off_the_loop(normalizing_checkpoint: Path) -> None:
    with ServerProcess("--model", str(normalizing_checkpoint)) as server:
        server.wait_ready()
        assert_not_encoded_on_the_loop(server, normalizing_checkpoint)
