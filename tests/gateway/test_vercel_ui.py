"""The Vercel AI SDK UI message stream (``POST /v1/ui/chat``) read by the AI SDK's own chat
client: the ``ai`` package's ``AbstractChat`` (what React's ``useChat`` wraps) with its
``DefaultChatTransport``, run under Node by tests/js/ui_chat.mjs against a real
``sluice serve``. The transport parses every chunk with the package's
``uiMessageChunkSchema`` and the chat applies them as ``useChat`` does, so a chunk out of
shape or out of order fails here."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.server import ServerProcess, wait_for_state

HARNESS = Path(__file__).parents[1] / "js" / "ui_chat.mjs"
MODEL = "sluice-tiny"
PROMPT = "What does socket.connect do?"
# Every run of the harness is one chat turn: a few seconds on a busy machine.
HARNESS_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def node() -> str:
    """The ``node`` binary, with the ``ai`` package installed beside the harness."""
    binary = shutil.which("node")
    if binary is None or not (HARNESS.parent / "node_modules" / "ai").is_dir():
        pytest.fail("Node and tests/js/node_modules are needed: run scripts/setup.sh --test")
    return binary


def chat(node: str, server: ServerProcess, text: str, **config: Any) -> dict[str, Any]:
    """One ``sendMessage`` of the AI SDK's chat; what the chat ended with."""
    config = {"api": f"{server.base_url}/v1/ui/chat", "text": text, **config}
    done = subprocess.run(
        [node, str(HARNESS), json.dumps(config)],
        capture_output=True,
        check=False,
        timeout=HARNESS_TIMEOUT_S,
        cwd=HARNESS.parent,
    )
    assert done.returncode == 0, done.stderr.decode()
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def assistant_text(result: dict[str, Any]) -> str:
    return "".join(
        part["text"]
        for message in result["messages"]
        if message["role"] == "assistant"
        for part in message["parts"]
        if part["type"] == "text"
    )


def test_use_chat_gets_the_text_the_openai_chat_dialect_streams(
    node: str, server: ServerProcess
) -> None:
    body = {"model": MODEL, "max_tokens": 12, "temperature": 0}
    result = chat(node, server, PROMPT, body=body)
    assert (result["status"], result["error"]) == ("ready", None)
    assert result["headers"]["x-vercel-ai-ui-message-stream"] == "v1"
    kinds = [chunk["type"] for chunk in result["chunks"]]
    assert kinds[:3] == ["start", "start-step", "text-start"]
    assert kinds[-3:] == ["text-end", "finish-step", "finish"]
    assert set(kinds[3:-3]) == {"text-delta"}
    finish = result["chunks"][-1]
    assert result["finish"] == {
        "isAbort": False,
        "isDisconnect": False,
        "isError": False,
        "finishReason": finish["finishReason"],
    }
    [user, assistant] = result["messages"]
    assert user["parts"] == [{"type": "text", "text": PROMPT}]
    assert assistant["id"] == result["chunks"][0]["messageId"]
    usage = assistant["metadata"]["usage"]
    assert usage["totalTokens"] == usage["inputTokens"] + usage["outputTokens"]
    assert 0 < usage["outputTokens"] <= 12

    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0) as sdk:
        chunks = sdk.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=12,
            temperature=0,
            stream=True,
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert assistant_text(result) == streamed
    assert streamed.strip()
    assert finish["finishReason"] in ("stop", "length")


def test_the_system_prompt_and_the_words_model_answer_the_last_message(
    node: str, server: ServerProcess
) -> None:
    result = chat(node, server, "one two  three", body={"model": "words", "system": "Echo."})
    assert assistant_text(result) == "one two  three"
    assert result["chunks"][-1]["finishReason"] == "stop"


def test_stopping_the_chat_cancels_the_generation(node: str, server: ServerProcess) -> None:
    body = {"model": MODEL, "max_tokens": 200, "ignore_eos": True}
    result = chat(node, server, PROMPT, body=body, stopAfterChars=1)
    assert result["stopped"]
    assert result["finish"]["isAbort"]
    assert result["status"] == "ready"
    stream_id = result["headers"]["x-sluice-stream-id"]
    assert wait_for_state(server, stream_id, "cancelled")["tokens"] < 200


def test_an_outside_cancel_reaches_use_chat_as_its_error(node: str, server: ServerProcess) -> None:
    body = {"model": MODEL, "max_tokens": 200, "ignore_eos": True}
    result = chat(node, server, PROMPT, body=body, cancelAfterChars=1)
    assert result["stopped"]
    assert result["status"] == "error"
    assert result["error"] == "the stream was cancelled"
    assert result["finish"]["isError"]
    assert result["chunks"][-1] == {"type": "error", "errorText": "the stream was cancelled"}
    assert assistant_text(result)  # what came before the cancel is kept


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"model": "gpt-9"}, "unknown model 'gpt-9'"),
        ({"model": "words", "temperature": 3}, "temperature"),
    ],
)
def test_a_refused_request_is_a_use_chat_error_with_the_reason(
    node: str, server: ServerProcess, body: dict[str, Any], needle: str
) -> None:
    result = chat(node, server, PROMPT, body=body)
    assert result["status"] == "error"
    assert needle in json.loads(result["error"])["error"]["message"]
    assert result["chunks"] == []


def test_a_resumable_chat_stopped_midway_resumes_to_the_whole_answer(
    node: str, server: ServerProcess
) -> None:
    """``resumeStream`` (the AI SDK's reconnect, a replay from the start) through
    ``GET /v1/streams/{id}/events``: one assistant message with the whole greedy answer."""
    body = {"model": MODEL, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    result = chat(
        node,
        server,
        PROMPT,
        body=body,
        headers={"X-Sluice-Resumable": "true"},
        stopAfterChars=1,
        resume={"api": f"{server.base_url}/v1/streams/{{streamId}}/events"},
    )
    assert result["stopped"]
    assert (result["status"], result["error"]) == ("ready", None)
    assert [m["role"] for m in result["messages"]] == ["user", "assistant"]
    whole = chat(node, server, PROMPT, body=body)
    assert assistant_text(result) == assistant_text(whole)
    assert result["messages"][1]["metadata"]["usage"]["outputTokens"] == 24
