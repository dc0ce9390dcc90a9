"""Chat templates: a list of messages (and tools) to the one prompt string a model continues.

A model that ships a chat template (the loader finds it: ``chat_template.jinja`` or
``tokenizer_config.json`` of a checkpoint, a GGUF's ``tokenizer.chat_template``) is rendered
with it as ``transformers``' ``apply_chat_template`` renders it: a sandboxed jinja2
environment with ``trim_blocks``, ``lstrip_blocks`` and the ``loopcontrols`` extension, a
``tojson`` filter that writes plain JSON (jinja2's own escapes ``<``, ``>``, ``&`` and
``'`` for HTML), the globals ``raise_exception`` and ``strftime_now``, and the variables
such templates expect:

- ``messages``: ``role``/``content`` dicts; an assistant message that called tools also has
  ``tool_calls`` (``[{"id", "type": "function", "function": {"name", "arguments"}}]``, the
  arguments parsed to a JSON object as vLLM passes them, or left as text when they are
  not one), and a ``tool`` message its ``tool_call_id``;
- ``tools``: the request's tools in OpenAI's shape (``[{"type": "function", "function":
  {"name", "description", "parameters"}}]``), only when there are some;
- ``add_generation_prompt`` (always true), ``bos_token``, ``eos_token``.

:attr:`ChatTemplate.renders_tools` says whether the template reads ``tools`` at all (found
in its syntax tree: ``jinja2.meta.find_undeclared_variables``, not by the model's name); a
model whose template does not cannot be shown tools, and the engine backend refuses them.

A checkpoint without one (the bundled ``sluice-tiny``, a plain language model) gets
:data:`SIMPLE_TEMPLATE`: each message on its own paragraph as ``Role: content``, a system
message first as plain text, then ``Assistant:`` for the model to continue::

    You are terse.

    User: What does socket.connect do?

    Assistant:
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from sluice.backends.base import ChatMessage, Tool, ToolCall
from sluice.errors import BadRequestError, ConfigError

__all__ = ["SIMPLE_TEMPLATE", "ChatTemplate"]

# Written with explicit line breaks: trim_blocks drops the one after each block tag.
SIMPLE_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'system' %}{{ m.content }}"
    "{% else %}{{ m.role | capitalize }}: {{ m.content }}{% endif %}{{ '\\n\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def _raise(message: str) -> None:
    raise BadRequestError(f"the chat template refused the messages: {message}")


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """``transformers``' ``tojson``: JSON as ``json.dumps`` writes it, not HTML-escaped."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


def _arguments(call: ToolCall) -> object:
    """A call's arguments as templates expect them: the object its JSON text holds."""
    try:
        value = json.loads(call.arguments)
    except ValueError:
        return call.arguments
    return value if isinstance(value, dict) else call.arguments


def _message(message: ChatMessage) -> dict[str, object]:
    rendered: dict[str, object] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        rendered["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": _arguments(call)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def _tool(tool: Tool) -> dict[str, object]:
    function: dict[str, object] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    if tool.parameters is not None:
        function["parameters"] = json.loads(tool.parameters)
    return {"type": "function", "function": function}


class ChatTemplate:
    """A compiled chat template; :meth:`render` gives the prompt for a list of messages."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise
        environment.globals["strftime_now"] = _strftime_now
        try:
            tree = environment.parse(source)
            self._template = environment.from_string(tree)
        except jinja2.TemplateError as exc:
            raise ConfigError(f"chat template does not compile: {exc}") from exc
        self.source = source
        self.renders_tools = "tools" in jinja2.meta.find_undeclared_variables(tree)
        self._bos = bos_token
        self._eos = eos_token

    def render(self, messages: Sequence[ChatMessage], tools: Sequence[Tool] = ()) -> str:
        """The prompt that asks the model for the next assistant message, ``tools`` in
        reach (given only to a template that :attr:`renders_tools`)."""
        if not messages:
            raise BadRequestError("messages must not be empty")
        if tools and not self.renders_tools:
            raise BadRequestError("tools: this model's chat template does not render tools")
        variables: dict[str, object] = {}
        if tools:
            variables["tools"] = [_tool(tool) for tool in tools]
        try:
            return self._template.render(
                messages=[_message(m) for m in messages],
                add_generation_prompt=True,
                bos_token=self._bos,
                eos_token=self._eos,
                **variables,
            )
        except jinja2.TemplateError as exc:
            raise BadRequestError(f"the chat template failed on these messages: {exc}") from exc
