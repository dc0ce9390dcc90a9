"""Chat templates: a list of messages to the one prompt string a model continues.

A model that ships a chat template (the loader finds it: ``chat_template.jinja`` or
``tokenizer_config.json`` of a checkpoint, a GGUF's ``tokenizer.chat_template``) is rendered
with it, in a sandboxed jinja2 environment, with the variables
such templates expect: ``messages`` (``role``/``content`` dicts), ``add_generation_prompt``
(always true), ``bos_token``, ``eos_token`` and ``raise_exception``.

A checkpoint without one (the bundled ``sluice-tiny``, a plain language model) gets
:data:`SIMPLE_TEMPLATE`: each message on its own paragraph as ``Role: content``, a system
message first as plain text, then ``Assistant:`` for the model to continue::

    You are terse.

    User: What does socket.connect do?

    Assistant:
"""

from __future__ import annotations

from collections.abc import Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from sluice.backends.base import ChatMessage
from sluice.errors import BadRequestError, ConfigError

__all__ = ["SIMPLE_TEMPLATE", "ChatTemplate"]

SIMPLE_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'system' %}{{ m.content }}"
    "{% else %}{{ m.role | capitalize }}: {{ m.content }}{% endif %}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def _raise(message: str) -> None:
    raise BadRequestError(f"the chat template refused the messages: {message}")


class ChatTemplate:
    """A compiled chat template; :meth:`render` gives the prompt for a list of messages."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        environment = ImmutableSandboxedEnvironment(trim_blocks=False, lstrip_blocks=False)
        environment.globals["raise_exception"] = _raise
        try:
            self._template = environment.from_string(source)
        except jinja2.TemplateError as exc:
            raise ConfigError(f"chat template does not compile: {exc}") from exc
        self.source = source
        self._bos = bos_token
        self._eos = eos_token

    def render(self, messages: Sequence[ChatMessage]) -> str:
        """The prompt that asks the model for the next assistant message."""
        if not messages:
            raise BadRequestError("messages must not be empty")
        try:
            return self._template.render(
                messages=[{"role": m.role, "content": m.content} for m in messages],
                add_generation_prompt=True,
                bos_token=self._bos,
                eos_token=self._eos,
            )
        except jinja2.TemplateError as exc:
            raise BadRequestError(f"the chat template failed on these messages: {exc}") from exc
