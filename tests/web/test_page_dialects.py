"""The page's dialect selector in real headless Chromium, against a real server: the same
stream in every wire format, the frames shown as they came, and Stop in each dialect.

Like tests/web/test_page.py, every wait is on the DOM (``document.body.dataset.state``,
the token count), never on the clock.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from playwright.sync_api import Browser, Page

from tests.server import ServerProcess, wait_for_state

pytestmark = pytest.mark.browser

WAIT_MS = 30_000
MODEL = "sluice-tiny"
PROMPT = "Return a new list containing all items from the iterable in ascending order."
# A double space, a newline and a tab that must come back exactly, in every dialect.
TEXT = "Tokens should  arrive one by one,\nas the model produces them,\tin any dialect."

# Each dialect, and a mark of its wire format that only it has.
DIALECTS = {
    "native": "event: token\n",
    "openai_chat": '"object":"chat.completion.chunk"',
    "openai_responses": "event: response.output_text.delta\n",
    "anthropic": "event: content_block_delta\n",
    "vercel_ui": '"type":"text-delta"',
}
LAST_FRAME = {
    "native": "event: done",
    "openai_chat": "data: [DONE]",
    "openai_responses": "event: response.completed",
    "anthropic": "event: message_stop",
    "vercel_ui": "data: [DONE]",
}


PATHS = {
    "openai_chat": "/v1/chat/completions",
    "openai_responses": "/v1/responses",
    "anthropic": "/v1/messages",
    "vercel_ui": "/v1/ui/chat",
}


# A model that paces its words (the compatible APIs cannot ask for a pace themselves): a
# Stop at the third of PACED_WORDS words always comes before the end. The bundled model
# cannot promise that: under load it finished 200 tokens before the page showed three.
PACED = "paced-words"
PACED_WORDS = " ".join(f"word{n}" for n in range(60))
PACED_CONFIG = f"""
[[alias]]
name = "{PACED}"
rollout = "manual"

[[alias.version]]
name = "v1"
model = "words"
weight = 100
stable = true
interval_ms = 50
"""


@pytest.fixture(scope="module", params=["native-sse", "asgi-sse"])
def paced_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """A server of the paced model, once per SSE delivery path (as tests/conftest.py's)."""
    config = tmp_path_factory.mktemp("paced") / "models.toml"
    config.write_text(PACED_CONFIG)
    options = ["--no-model", "--models-config", str(config)]
    if request.param == "asgi-sse":
        options.append("--no-native-sse")
    with ServerProcess(*options) as server:
        yield server.wait_ready()


def _open(browser: Browser, server: ServerProcess) -> Page:
    context = browser.new_context(base_url=server.base_url)
    context.set_default_timeout(WAIT_MS)
    page = context.new_page()
    page.goto("/")
    page.wait_for_function("document.getElementById('model').options.length > 0")
    return page


@pytest.fixture
def page(browser: Browser, server: ServerProcess) -> Iterator[Page]:
    page = _open(browser, server)
    yield page
    page.context.close()


@pytest.fixture
def paced_page(browser: Browser, paced_server: ServerProcess) -> Iterator[Page]:
    page = _open(browser, paced_server)
    yield page
    page.context.close()


def _text(page: Page, selector: str) -> str:
    return str(page.eval_on_selector(selector, "e => e.textContent"))


def _frames(page: Page) -> list[str]:
    return list(page.eval_on_selector_all("#wire .frame", "fs => fs.map(f => f.textContent)"))


def _run(page: Page, dialect: str, *, model: str, prompt: str, max_tokens: int = 64) -> str:
    """Start one stream in ``dialect`` and wait for its end; the state it ended in."""
    page.select_option("#dialect", dialect)
    page.select_option("#model", model)
    page.fill("#prompt", prompt)
    page.fill("#max-tokens", str(max_tokens))
    if model != "words":
        page.fill("#temperature", "0")
    page.click("#start")
    page.wait_for_function("() => /^(done|error)/.test(document.body.dataset.state)")
    return _text(page, "#state")


def test_the_words_model_streams_the_same_text_in_every_dialect(page: Page) -> None:
    for dialect, mark in DIALECTS.items():
        assert _run(page, dialect, model="words", prompt=TEXT) == "done:stop", dialect
        assert _text(page, "#output") == TEXT, dialect
        assert _text(page, "#message") == ""
        frames = _frames(page)
        assert any(mark in frame for frame in frames), (dialect, frames[:3])
        assert frames[-1].startswith(LAST_FRAME[dialect]), (dialect, frames[-1])
        assert int(_text(page, "#tokens")) == len(TEXT.split())


def test_the_model_streams_the_same_greedy_text_in_every_chat_dialect(page: Page) -> None:
    """The compatible dialects send the prompt as a user message (through the model's chat
    template); the native stream continues the prompt as written, so it is left out."""
    texts = {}
    for dialect in PATHS:
        state = _run(page, dialect, model=MODEL, prompt=PROMPT, max_tokens=12)
        assert state in ("done:stop", "done:length"), (dialect, _text(page, "#message"))
        texts[dialect] = _text(page, "#output")
    assert texts["openai_chat"].strip()
    assert set(texts.values()) == {texts["openai_chat"]}, texts


@pytest.mark.parametrize("dialect", list(PATHS))
def test_stop_cancels_the_stream_in_every_compatible_dialect(
    paced_page: Page, paced_server: ServerProcess, dialect: str
) -> None:
    page = paced_page
    page.select_option("#dialect", dialect)
    page.select_option("#model", PACED)
    page.fill("#prompt", PACED_WORDS)
    page.fill("#max-tokens", "200")
    # Stop from inside the page in the task that shows the third token (see test_page.py).
    page.evaluate(
        """() => {
            const tokens = document.getElementById('tokens');
            const observer = new MutationObserver(() => {
                if (Number(tokens.textContent) >= 3) {
                    observer.disconnect();
                    document.getElementById('stop').click();
                }
            });
            observer.observe(tokens, {childList: true, characterData: true, subtree: true});
        }"""
    )
    page.click("#start")
    page.wait_for_function("() => document.body.dataset.state === 'done:cancelled'")
    assert int(_text(page, "#tokens")) >= 3
    assert page.is_enabled("#start")
    assert wait_for_state(paced_server, _text(page, "#stream-id"), "cancelled")["tokens"] < 60
