"""PromptPreparer: small prompts are made inline, large ones rendered and encoded on its
worker threads (never more at once than it has workers, a cancelled request's work never
run), and a prompt whose least possible token count cannot fit is refused unencoded."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator, Sequence

import pytest

from sluice.backends.base import ChatMessage, GenerationRequest
from sluice.backends.chat import SIMPLE_TEMPLATE, ChatTemplate
from sluice.backends.prompt import INLINE_MAX_CHARS, PromptPreparer
from sluice.cli import BUNDLED_MODEL
from sluice.engine.tokenizer import Tokenizer

pytestmark = pytest.mark.anyio

MAX_MODEL_LEN = 256  # the bundled model's
WAIT_S = 10.0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class RecordingEncoder:
    """The bundled tokenizer, noting the thread of each encode; ``hold`` keeps every encode
    waiting until it is set, so that a test sees how many run at once."""

    def __init__(self) -> None:
        self._tokenizer = Tokenizer.from_file(BUNDLED_MODEL / "tokenizer.json")
        self.hold = threading.Event()
        self.hold.set()
        self.threads: list[str] = []
        self.texts: list[str] = []
        self._condition = threading.Condition()
        self.num_running = 0
        self.max_running = 0

    def encode(self, text: str) -> list[int]:
        with self._condition:
            self.threads.append(threading.current_thread().name)
            self.texts.append(text)
            self.num_running += 1
            self.max_running = max(self.max_running, self.num_running)
            self._condition.notify_all()
        try:
            assert self.hold.wait(WAIT_S)
            return self._tokenizer.encode(text)
        finally:
            with self._condition:
                self.num_running -= 1

    def min_num_tokens(self, text: str) -> int:
        return self._tokenizer.min_num_tokens(text)

    def wait_running(self, count: int) -> None:
        with self._condition:
            assert self._condition.wait_for(lambda: self.num_running == count, WAIT_S)


class RecordingTemplate(ChatTemplate):
    """The simple template, noting the thread of each render."""

    def __init__(self) -> None:
        super().__init__(SIMPLE_TEMPLATE)
        self.threads: list[str] = []

    def render(self, messages: Sequence[ChatMessage]) -> str:
        self.threads.append(threading.current_thread().name)
        return super().render(messages)


@pytest.fixture
def encoder() -> RecordingEncoder:
    return RecordingEncoder()


@pytest.fixture
def template() -> RecordingTemplate:
    return RecordingTemplate()


@pytest.fixture
def preparer(encoder: RecordingEncoder, template: RecordingTemplate) -> Iterator[PromptPreparer]:
    preparer = PromptPreparer(encoder, template, MAX_MODEL_LEN)
    yield preparer
    encoder.hold.set()
    preparer.close()


def large_prompt(word: str = "a") -> str:
    """Over INLINE_MAX_CHARS characters but, at 2 bytes a token at most, within context."""
    return f"{word} " * (INLINE_MAX_CHARS // 2 + 8)


async def test_a_small_prompt_is_encoded_inline(
    preparer: PromptPreparer, encoder: RecordingEncoder
) -> None:
    prompt = "The quick brown fox"
    ids = await preparer.prompt_ids(GenerationRequest(prompt), 8)
    assert ids == Tokenizer.from_file(BUNDLED_MODEL / "tokenizer.json").encode(prompt)
    assert encoder.threads == [threading.current_thread().name]


async def test_a_large_prompt_is_encoded_on_a_worker(
    preparer: PromptPreparer, encoder: RecordingEncoder
) -> None:
    prompt = large_prompt()
    ids = await preparer.prompt_ids(GenerationRequest(prompt), 8)
    assert ids == Tokenizer.from_file(BUNDLED_MODEL / "tokenizer.json").encode(prompt)
    assert len(encoder.threads) == 1
    assert encoder.threads[0].startswith("sluice-prompt")


async def test_large_chat_messages_are_rendered_and_encoded_on_workers(
    preparer: PromptPreparer, encoder: RecordingEncoder, template: RecordingTemplate
) -> None:
    messages = (ChatMessage("system", "Be terse."), ChatMessage("user", large_prompt()))
    await preparer.prompt_ids(GenerationRequest("", messages=messages), 8)
    assert template.threads[0].startswith("sluice-prompt")
    assert encoder.threads[0].startswith("sluice-prompt")
    await preparer.prompt_ids(GenerationRequest("", messages=messages[:1]), 8)
    assert template.threads[1] == threading.current_thread().name


async def test_a_prompt_that_cannot_fit_is_refused_before_it_is_encoded(
    preparer: PromptPreparer, encoder: RecordingEncoder
) -> None:
    with pytest.raises(ValueError, match="at least 6188 tokens plus max_tokens=8"):
        await preparer.prompt_ids(GenerationRequest("xq " * 66_000), 8)
    assert encoder.threads == []


async def test_large_prompts_run_on_at_most_two_workers_and_a_cancelled_one_never_runs(
    preparer: PromptPreparer, encoder: RecordingEncoder
) -> None:
    encoder.hold.clear()
    prompts = [large_prompt(word) for word in ("a", "b", "c", "d", "e")]
    tasks = [asyncio.ensure_future(preparer.prompt_ids(GenerationRequest(p), 8)) for p in prompts]
    await asyncio.to_thread(encoder.wait_running, 2)  # the first two hold both workers
    tasks[4].cancel()
    await asyncio.sleep(0)  # one loop pass: the cancel reaches the pool's queue
    encoder.hold.set()
    done = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(done[4], asyncio.CancelledError)
    assert all(isinstance(ids, list) for ids in done[:4])
    assert encoder.max_running == 2
    assert sorted(encoder.texts) == prompts[:4]
