"""Tool calling on the engine, in-process: templates that render tools, the engine backend
reading the model's ``<tool_call>`` blocks into ToolCallDelta events, and the requests it
refuses naming the field.

The model is :mod:`tests.engine.tool_model`'s: greedy decoding writes a known Hermes-style
tool call, so what the backend makes of it is exact. Its template renders the same prompt
as ``transformers``' ``apply_chat_template`` for tools, calls and results."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
import transformers

from sluice.backends.base import (
    ChatMessage,
    Delta,
    GenerationRequest,
    ResponseFormat,
    Tool,
    ToolCall,
    ToolChoice,
    ToolChoiceMode,
)
from sluice.backends.chat import SIMPLE_TEMPLATE, ChatTemplate
from sluice.backends.engine import EngineBackend
from sluice.dialects import native
from sluice.engine.default_model import default_model_file
from sluice.engine.driver import AsyncEngine
from sluice.engine.engine import Engine, EngineConfig
from sluice.engine.loader import Checkpoint, load_checkpoint
from sluice.errors import BadRequestError, InvalidParameterError
from sluice.events import FinishReason, TextDelta, ToolCallDelta
from tests.engine.tool_model import (
    ANSWER_TEXT,
    ARGUMENTS,
    HERMES_TEMPLATE,
    PREAMBLE,
    TOOL_NAME,
    write_tool_model,
)

pytestmark = pytest.mark.anyio

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "description": "a city <name> & 'quote'"}},
    "required": ["city"],
}
WEATHER = Tool(TOOL_NAME, "The weather in a city now.", orjson.dumps(SCHEMA).decode())
QUESTION = ChatMessage("user", "What is the weather in Paris?")
HISTORY = (
    ChatMessage("system", "Use the tools you are given."),
    QUESTION,
    ChatMessage("assistant", "", (ToolCall("call_1", TOOL_NAME, '{"city": "Paris"}'),)),
    ChatMessage("tool", "sunny, 21 C", tool_call_id="call_1"),
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return load_checkpoint(write_tool_model(tmp_path_factory.mktemp("tools") / "hermes-tiny"))


def openai_messages(messages: tuple[ChatMessage, ...]) -> list[dict[str, Any]]:
    """The messages as a client sends them to ``transformers`` (arguments as objects)."""
    shaped: list[dict[str, Any]] = []
    for m in messages:
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": orjson.loads(c.arguments)},
                }
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        shaped.append(message)
    return shaped


def hermes_tokenizer(checkpoint: Checkpoint) -> transformers.PreTrainedTokenizerBase:
    backend = checkpoint.tokenizer.backend
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend)  # type: ignore[no-untyped-call]


OPENAI_TOOL = {
    "type": "function",
    "function": {"name": WEATHER.name, "description": WEATHER.description, "parameters": SCHEMA},
}


@pytest.mark.parametrize("messages", [(QUESTION,), HISTORY], ids=["question", "history"])
def test_tools_calls_and_results_render_as_transformers_renders_them(
    checkpoint: Checkpoint, messages: tuple[ChatMessage, ...]
) -> None:
    expected = hermes_tokenizer(checkpoint).apply_chat_template(
        openai_messages(messages),
        tools=[OPENAI_TOOL],
        chat_template=HERMES_TEMPLATE,
        tokenize=False,
        add_generation_prompt=True,
    )
    ours = ChatTemplate(HERMES_TEMPLATE).render(messages, (WEATHER,))
    assert ours == expected
    assert "a city <name> & 'quote'" in ours  # tojson writes JSON, not HTML escapes
    if messages == HISTORY:
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in ours
        assert "<tool_response>\nsunny, 21 C\n</tool_response>" in ours


def test_templates_are_known_to_render_tools_from_their_syntax_not_their_name() -> None:
    assert ChatTemplate(HERMES_TEMPLATE).renders_tools
    assert ChatTemplate("{% if tools %}{{ tools | length }}{% endif %}").renders_tools
    assert not ChatTemplate(SIMPLE_TEMPLATE).renders_tools
    assert not ChatTemplate("{% set tools = [] %}{{ tools }}{{ messages }}").renders_tools
    assert not ChatTemplate("{{ 'tools' }} {{ messages[0].content }}").renders_tools


def test_the_default_models_template_renders_no_tools() -> None:
    smollm2 = load_checkpoint(default_model_file())
    assert smollm2.chat_template is not None
    assert not ChatTemplate(smollm2.chat_template).renders_tools


def test_a_template_without_tools_refuses_to_be_given_some() -> None:
    with pytest.raises(BadRequestError, match=r"^tools:"):
        ChatTemplate(SIMPLE_TEMPLATE).render((QUESTION,), (WEATHER,))


def test_the_simple_template_keeps_its_paragraphs() -> None:
    messages = (ChatMessage("system", "You are terse."), ChatMessage("user", "Hi?"))
    assert ChatTemplate(SIMPLE_TEMPLATE).render(messages) == (
        "You are terse.\n\nUser: Hi?\n\nAssistant:"
    )


@contextlib.asynccontextmanager
async def serving(
    checkpoint: Checkpoint, template: str = HERMES_TEMPLATE
) -> AsyncIterator[EngineBackend]:
    """An engine backend on the tool model, its driver running."""
    config = EngineConfig(
        num_blocks=128,
        block_size=16,
        max_num_seqs=4,
        max_num_batched_tokens=512,
        max_waiting=8,
        max_model_len=2048,
    )
    tokenizer = checkpoint.tokenizer
    engine = Engine(
        checkpoint.model,
        config,
        eos_token_id=tokenizer.eos_token_ids,
        token_bytes=tokenizer.token_bytes,
    )
    async with AsyncEngine(engine) as driver:
        backend = EngineBackend(
            "hermes-tiny",
            driver,
            tokenizer,
            default_max_tokens=64,
            chat_template=ChatTemplate(template),
        )
        try:
            yield backend
        finally:
            await backend.aclose()


async def generate(backend: EngineBackend, request: GenerationRequest) -> list[Delta]:
    return [delta async for delta in backend.generate(request)]


def chat(messages: tuple[ChatMessage, ...] = (QUESTION,), **fields: Any) -> GenerationRequest:
    return GenerationRequest("", messages, temperature=0, **fields)


def events_of(deltas: list[Delta]) -> list[TextDelta | ToolCallDelta]:
    return [event for delta in deltas for event in delta.events]


async def test_a_tool_call_the_model_writes_becomes_a_tool_call_event(
    checkpoint: Checkpoint,
) -> None:
    async with serving(checkpoint) as backend:
        deltas = await generate(backend, chat(tools=(WEATHER,)))
    events = events_of(deltas)
    assert events[0] == TextDelta(PREAMBLE)
    (call,) = events[1:]
    assert isinstance(call, ToolCallDelta)
    assert (call.index, call.name) == (0, TOOL_NAME)
    assert orjson.loads(call.arguments_delta) == ARGUMENTS
    assert call.id is not None
    assert call.id.startswith("call_")
    assert deltas[-1].finish_reason is FinishReason.TOOL_CALLS
    assert deltas[-1].stop_sequence is None
    assert [name for name, _ in map(native.render, events)] == ["token", "tool_call"]
    _, data = native.render(call)
    assert orjson.loads(data) == {
        "index": 0,
        "id": call.id,
        "name": TOOL_NAME,
        "arguments": '{"city":"Paris"}',
    }


async def test_a_history_with_calls_and_results_is_rendered_into_the_prompt(
    checkpoint: Checkpoint,
) -> None:
    async with serving(checkpoint) as backend:
        generation = backend.generate(chat(HISTORY, tools=(WEATHER,)))
        deltas = [delta async for delta in generation]
    assert deltas[-1].finish_reason is FinishReason.TOOL_CALLS
    prompt = ChatTemplate(HERMES_TEMPLATE).render(HISTORY, (WEATHER,))
    assert generation.usage().prompt_tokens == len(checkpoint.tokenizer.encode(prompt))


async def test_tools_with_tool_choice_none_are_not_shown_and_nothing_is_parsed(
    checkpoint: Checkpoint,
) -> None:
    async with serving(checkpoint) as backend:
        deltas = await generate(
            backend, chat(tools=(WEATHER,), tool_choice=ToolChoice(ToolChoiceMode.NONE))
        )
    assert "".join(e.text for e in events_of(deltas) if isinstance(e, TextDelta)) == ANSWER_TEXT
    assert deltas[-1].finish_reason is FinishReason.STOP


async def test_a_cut_off_call_is_text_and_the_answer_ends_by_length(
    checkpoint: Checkpoint,
) -> None:
    async with serving(checkpoint) as backend:
        deltas = await generate(backend, chat(tools=(WEATHER,), max_tokens=4))
    events = events_of(deltas)
    assert all(isinstance(e, TextDelta) for e in events)
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert text == PREAMBLE + '\n<tool_call>\n{"name": "get_weather", '
    assert deltas[-1].finish_reason is FinishReason.LENGTH


REFUSED = [
    ("tools", chat(tools=(WEATHER,)), SIMPLE_TEMPLATE),
    (
        "tool_choice",
        chat(tools=(WEATHER,), tool_choice=ToolChoice(ToolChoiceMode.REQUIRED)),
        HERMES_TEMPLATE,
    ),
    (
        "tool_choice",
        chat(tools=(WEATHER,), tool_choice=ToolChoice(ToolChoiceMode.FUNCTION, TOOL_NAME)),
        HERMES_TEMPLATE,
    ),
    ("response_format", chat(response_format=ResponseFormat("json_object")), HERMES_TEMPLATE),
    ("messages", chat(HISTORY), SIMPLE_TEMPLATE),
]


@pytest.mark.parametrize(("param", "request_", "template"), REFUSED)
async def test_what_the_engine_cannot_honour_is_refused_naming_the_field(
    checkpoint: Checkpoint, param: str, request_: GenerationRequest, template: str
) -> None:
    async with serving(checkpoint, template) as backend:
        generation = backend.generate(request_)
        with pytest.raises(InvalidParameterError) as refused:
            await generation.start()
        stats = await backend.stats()
    assert refused.value.param == param
    assert str(refused.value).startswith(f"{param}:")
    assert stats["running"] == stats["waiting"] == stats["kv_blocks_used"] == 0
