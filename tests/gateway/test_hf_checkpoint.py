"""A transformers-5 checkpoint directory of SmolLM2-135M-Instruct, served as it is.

The directory is made here, as ``transformers`` 5 lays one out: its tokenizer files
(``tokenizer.json``, ``tokenizer_config.json`` naming ``<|im_end|>`` as EOS, the template in
``chat_template.jinja``) saved by ``transformers`` from the default model's GGUF, its
``config.json`` and ``generation_config.json`` written by ``transformers``' config classes,
and the weights (our loader's, equal bit for bit to ``transformers``' own dequantization:
``tests/engine/test_gguf_conformance.py``) in ``model.safetensors``. Before the template of
``chat_template.jinja`` and the tokenizer config's EOS were read, such a directory streamed
``<|im_end|>`` and kept going.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import transformers
from safetensors.torch import save_file

from sluice.engine.default_model import default_model_file
from sluice.engine.loader import load_checkpoint
from sluice.engine.models import LlamaConfig
from tests.server import ServerProcess

pytestmark = pytest.mark.timeout(300)

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
ANSWER = "The capital of France is Paris."


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("hf") / "smollm2-hf"
    gguf_path = default_model_file()
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name
    )
    tokenizer.save_pretrained(directory)
    assert (directory / "chat_template.jinja").is_file()
    loaded = load_checkpoint(gguf_path)
    config = loaded.config
    assert isinstance(config, LlamaConfig)
    transformers.LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    ).save_pretrained(directory)
    transformers.GenerationConfig(bos_token_id=1, eos_token_id=[2]).save_pretrained(directory)
    state = {k: v for k, v in loaded.model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(directory / "model.safetensors"))
    return directory


@pytest.fixture(scope="module")
def client(checkpoint_dir: Path) -> Iterator[openai.OpenAI]:
    with ServerProcess("--model", str(checkpoint_dir), "--kv-blocks", "64") as server:
        server.wait_ready(timeout_s=240)
        yield openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_the_checkpoints_template_and_eos_end_the_answer(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model="smollm2-hf", messages=QUESTION, max_tokens=32, temperature=0, stream=True
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ANSWER
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
