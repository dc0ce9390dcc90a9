"""SmolLM2-135M-Instruct through our GGUF loader against ``transformers`` on the same file.

``transformers`` reads the GGUF with its own reader and its own dequantization kernels
(``transformers.integrations.gguf``), and undoes llama.cpp's Q/K permutation its own way, so
it is an independent reference for all three of ours. On the default model's file
(Q4_1 and Q8_0 weights), for five chat prompts of different lengths:

- every weight dequantizes to exactly the same float32 values;
- the chat template renders the same prompt text and the tokenizer gives the same ids;
- prefill logits through the paged cache agree within :data:`LOGITS_ATOL` (fp32 over 30
  layers: the largest difference measured was 5e-5, on logits of magnitude up to 34);
- the engine's greedy tokens (all five in one batch, stopping at EOS) equal
  ``generate(do_sample=False)`` token for token.

The prompts have no digits: on numbers ``transformers``' GGUF tokenizer splits differently
from llama.cpp (see :mod:`sluice.engine.gguf_vocab`).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from sluice.backends.base import ChatMessage
from sluice.backends.chat import ChatTemplate
from sluice.engine.default_model import default_model_file
from sluice.engine.engine import Engine, EngineConfig
from sluice.engine.loader import Checkpoint, load_checkpoint
from sluice.engine.models import StepSequence
from sluice.engine.sampling_params import SamplingParams

# Loading the model twice and generating takes tens of seconds on a busy 2-core machine.
pytestmark = pytest.mark.timeout(600)

LOGITS_ATOL = 2e-4
NUM_NEW_TOKENS = 12
BLOCK_SIZE = 16
PARAGRAPH = (
    "Server-sent events let a web server push text to a browser over one long HTTP "
    "response. The browser reconnects by itself when the connection drops, and tells the "
    "server the identifier of the last event it saw, so that the server can resume the "
    "stream where it stopped. Language model servers use them to deliver tokens as they "
    "are produced, which makes a chat feel fast even when the whole answer takes a while."
)
CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name a colour of the sky."},
    ],
    [
        {"role": "user", "content": "What is a cat?"},
        {"role": "assistant", "content": "A cat is a small domesticated animal."},
        {"role": "user", "content": "And a dog?"},
    ],
    [{"role": "user", "content": f"Summarize this paragraph in one sentence.\n\n{PARAGRAPH}"}],
]


@pytest.fixture(scope="module")
def ours() -> Checkpoint:
    return load_checkpoint(default_model_file())


@pytest.fixture(scope="module")
def theirs() -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase]:
    path = default_model_file()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def prompts(
    ours: Checkpoint,
    theirs: tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase],
) -> list[list[int]]:
    """The five conversations' prompt ids, checked equal on both sides first."""
    _, tokenizer = theirs
    assert ours.chat_template is not None
    template = ChatTemplate(ours.chat_template, bos_token=ours.bos_token, eos_token=ours.eos_token)
    ids = []
    for conversation in CONVERSATIONS:
        text = template.render([ChatMessage(**message) for message in conversation])
        expected = tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True
        )
        assert text == expected
        prompt = ours.tokenizer.encode(text)
        assert prompt == tokenizer(text, add_special_tokens=True)["input_ids"]
        ids.append(prompt)
    lengths = sorted(len(p) for p in ids)
    assert lengths[0] < 30 < 100 < lengths[-1]
    return ids


def test_every_weight_dequantizes_exactly_as_transformers(
    ours: Checkpoint,
    theirs: tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase],
) -> None:
    expected = theirs[0].state_dict()
    actual = ours.model.state_dict()
    assert set(actual) == set(expected)
    for name, weight in actual.items():
        assert torch.equal(weight, expected[name]), name


def test_prefill_logits_agree_with_transformers(
    ours: Checkpoint,
    theirs: tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase],
    prompts: list[list[int]],
) -> None:
    model = theirs[0]
    for ids in prompts:
        num_blocks = -(-len(ids) // BLOCK_SIZE)
        cache = ours.model.make_kv_cache(num_blocks, BLOCK_SIZE)
        step = StepSequence(0, len(ids), len(ids), list(range(num_blocks))[::-1])
        with torch.inference_mode():
            logits = ours.model(torch.tensor(ids), torch.arange(len(ids)), [step], cache)[0]
            expected = model(torch.tensor([ids])).logits[0, -1]
        torch.testing.assert_close(logits, expected, atol=LOGITS_ATOL, rtol=0)
        assert logits.argmax() == expected.argmax()


def test_engine_greedy_tokens_equal_transformers_generate(
    ours: Checkpoint,
    theirs: tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase],
    prompts: list[list[int]],
) -> None:
    config = EngineConfig(
        num_blocks=64,
        block_size=BLOCK_SIZE,
        max_num_seqs=8,
        max_num_batched_tokens=64,  # the long prompt prefills in chunks beside the others
        max_waiting=8,
        max_model_len=512,
    )
    tokenizer = ours.tokenizer
    engine = Engine(
        ours.model, config, eos_token_id=tokenizer.eos_token_ids, token_bytes=tokenizer.token_bytes
    )
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0)
    request_ids = [engine.add_request(p, params) for p in prompts]
    generated: dict[int, list[int]] = {r: [] for r in request_ids}
    while engine.has_unfinished_requests():
        for output in engine.step():
            generated[output.request_id] += output.new_token_ids
    model = theirs[0]
    for request_id, prompt in zip(request_ids, prompts, strict=True):
        with torch.inference_mode():
            reference = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=NUM_NEW_TOKENS,
            )
        assert generated[request_id] == reference[0, len(prompt) :].tolist()
