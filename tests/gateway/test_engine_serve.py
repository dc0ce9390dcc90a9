"""``sluice serve``: the bundled ``sluice-tiny`` (``--model models/sluice-tiny``, as the test
server runs it), ``--model DIR`` for any checkpoint directory, streamed by the embedded
engine; ``--no-model`` for the words demo alone. The default model (no flag) is tested in
``test_default_model.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import orjson
import pytest
import torch
from safetensors.torch import save_file

from sluice.cli import BUNDLED_MODEL
from sluice.engine.engine import Engine, EngineConfig
from sluice.engine.loader import load_checkpoint
from sluice.engine.models.gpt2 import GPT2Config, GPT2LMHeadModel
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.tokenizer import Tokenizer
from sluice.sse import Decoder
from tests.server import ServerProcess
from tests.tiny_tokenizer import train_tokenizer

CORPUS = ["The quick brown fox jumps over the lazy dog. Streams of tokens arrive."] * 30


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("ckpt") / "tiny-test"
    directory.mkdir()
    train_tokenizer(directory / "tokenizer.json", CORPUS)
    vocab_size = Tokenizer.from_file(directory / "tokenizer.json").vocab_size
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=vocab_size, n_positions=128, n_embd=32, n_layer=2, n_head=4)
    model = GPT2LMHeadModel(config)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(directory / "model.safetensors"))
    hf_config = {"model_type": "gpt2", "activation_function": "gelu_new", **vars(config)}
    (directory / "config.json").write_text(json.dumps(hf_config))
    return directory


def test_a_checkpoint_is_served_as_the_default_model(checkpoint: Path) -> None:
    with ServerProcess("--model", str(checkpoint), "--kv-blocks", "64") as server:
        models_listed = httpx.get(f"{server.base_url}/v1/models", timeout=30).json()
        assert {m["id"] for m in models_listed["data"]} == {"words", "tiny-test"}
        # A random model may sample its end-of-text token: ignore_eos makes the count exact.
        body = {"prompt": "The quick", "max_tokens": 6, "ignore_eos": True}
        created = httpx.post(f"{server.base_url}/v1/streams", json=body).json()
        assert created["model"] == "tiny-test"
        body = httpx.get(f"{server.base_url}{created['events_url']}", timeout=30).content
        events = Decoder().feed(body)
        names = [e.event for e in events]
        assert names[0] == "start"
        assert names[-2:] == ["usage", "done"]
        usage = orjson.loads(events[-2].data)
        assert usage["completion_tokens"] == 6
        assert usage["prompt_tokens"] > 0
        assert orjson.loads(events[-1].data) == {"reason": "length"}

        def text_of(**sampling: object) -> str:
            body = {"prompt": "The quick", "max_tokens": 8, **sampling}
            created = httpx.post(f"{server.base_url}/v1/streams", json=body).json()
            raw = httpx.get(f"{server.base_url}{created['events_url']}", timeout=30).content
            tokens = [
                orjson.loads(e.data)["text"] for e in Decoder().feed(raw) if e.event == "token"
            ]
            return "".join(tokens)

        assert text_of(temperature=1.0, seed=7) == text_of(temperature=1.0, seed=7)
        assert text_of(temperature=0) == text_of(temperature=0, top_p=0.5, top_k=3)
        assert server.stop() == 0


def test_a_broken_model_directory_stops_serve_with_a_clear_message(tmp_path: Path) -> None:
    with ServerProcess("--model", str(tmp_path)) as server:
        assert server.process is not None
        assert server.process.wait(timeout=60) == 2


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--ttft-slo", "0"], "--ttft-slo must be positive"),
        (["--ttft-slo", "1", "--ttft-headroom", "1"], "--ttft-headroom must be"),
        (["--ttft-headroom", "-0.1"], "--ttft-headroom must be"),
    ],
)
def test_an_impossible_ttft_objective_stops_serve_with_a_clear_message(
    options: list[str], message: str
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sluice.cli", "serve", "--port", "0", *options],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert message in result.stderr


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--device", "cuda"], "sees no CUDA device"),
        (["--device", "tpu"], "expected auto, cpu, cuda or cuda:N"),
        (["--dtype", "float16"], "not served on the CPU"),
    ],
)
def test_a_device_or_dtype_the_machine_lacks_stops_serve_with_a_clear_message(
    options: list[str], message: str
) -> None:
    """This project's torch is the CPU build: a GPU asked for is refused at start."""
    if torch.cuda.is_available() and options[0] == "--device":  # a GPU machine has one
        options = ["--device", "cuda:99"]
        message = "CUDA device(s)"
    command = [sys.executable, "-m", "sluice.cli", "serve", "--port", "0"]
    result = subprocess.run(
        [*command, "--model", str(BUNDLED_MODEL), *options],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2
    assert message in result.stderr


def test_the_bundled_model_served_in_bfloat16_streams_its_greedy_text() -> None:
    """``--dtype bfloat16`` (the CPU's half precision; a GPU's default): weights and KV
    cache in bf16, sampling in fp32; the bundled model's greedy text is fp32's here."""
    prompt = {"prompt": "Return the number of", "max_tokens": 12, "temperature": 0}
    texts = []
    for dtype in ("float32", "bfloat16"):
        options = ("--model", str(BUNDLED_MODEL), "--dtype", dtype, "--kv-blocks", "64")
        with ServerProcess(*options) as server:
            server.wait_ready()  # loading takes seconds on a busy machine
            created = httpx.post(f"{server.base_url}/v1/streams", json=prompt, timeout=60).json()
            raw = httpx.get(f"{server.base_url}{created['events_url']}", timeout=60).content
            events = Decoder().feed(raw)
            assert orjson.loads(events[-1].data) == {"reason": "length"}
            texts.append(
                "".join(orjson.loads(e.data)["text"] for e in events if e.event == "token")
            )
            assert server.stop() == 0
    assert texts[0].strip()
    assert texts[1] == texts[0]


def test_the_bundled_model_streams_the_engines_greedy_tokens(
    server: ServerProcess,
) -> None:
    prompt, max_tokens = "Return the number of", 12
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    created = httpx.post(f"{server.base_url}/v1/streams", json=body).json()
    assert created["model"] == "sluice-tiny"
    raw = httpx.get(f"{server.base_url}{created['events_url']}", timeout=30).content
    events = Decoder().feed(raw)
    text = "".join(orjson.loads(e.data)["text"] for e in events if e.event == "token")

    checkpoint = load_checkpoint(BUNDLED_MODEL)
    config = EngineConfig(
        num_blocks=16,
        block_size=16,
        max_num_seqs=1,
        max_num_batched_tokens=64,
        max_waiting=1,
        max_model_len=64,
    )
    tokenizer = checkpoint.tokenizer
    engine = Engine(
        checkpoint.model,
        config,
        eos_token_id=tokenizer.eos_token_id,
        token_bytes=tokenizer.token_bytes,
    )
    request_id = engine.add_request(
        tokenizer.encode(prompt), SamplingParams(max_tokens=max_tokens, temperature=0)
    )
    expected, reason = "", None
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.request_id == request_id
            expected += output.new_text
            reason = output.finish_reason
    assert text == expected
    assert text.strip()
    assert "\ufffd" not in text
    assert orjson.loads(events[-1].data) == {"reason": str(reason)}


def test_no_model_serves_only_words() -> None:
    with ServerProcess("--no-model") as server:
        models_listed = httpx.get(f"{server.base_url}/v1/models", timeout=30).json()
        assert [m["id"] for m in models_listed["data"]] == ["words"]
        created = httpx.post(f"{server.base_url}/v1/streams", json={"prompt": "a b"}).json()
        assert created["model"] == "words"
