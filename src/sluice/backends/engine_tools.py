"""What the engine backend makes of a request's tool fields and of its model's answer.

A request's ``tools`` are shown to the model when its chat template renders them
(:attr:`~sluice.backends.chat.ChatTemplate.renders_tools`, found in the template's syntax);
the model's answer is then read by a
:class:`~sluice.backends.tool_call_parser.HermesToolCallParser`: its ``<tool_call>`` blocks
become :class:`~sluice.events.ToolCallDelta` events, and an answer that ended normally (an
end-of-sequence token or a stop string) after at least one call finishes with
``tool_calls``; one cut by ``max_tokens`` stays ``length``.

Refused by :func:`tools_to_show` with an :class:`~sluice.errors.InvalidParameterError`
naming the field (a 400, before anything is queued), in this order:

1. ``tools`` when the template does not render tools, unless ``tool_choice`` is ``none``:
   then the model is not shown them and nothing is parsed (the model must not call one);
2. a ``required`` or named ``tool_choice``, and a ``json_object`` or ``json_schema``
   ``response_format``: the engine does not constrain its output, so it cannot promise
   them;
3. ``messages`` holding tool calls when the template does not render tools.

``parallel_tool_calls: false`` is not enforced (as in vLLM): a model that writes several
calls has them all reported.
"""

from __future__ import annotations

from sluice.backends.base import Delta, GenerationRequest, Tool, ToolChoiceMode
from sluice.backends.tool_call_parser import HermesToolCallParser
from sluice.errors import InvalidParameterError
from sluice.events import FinishReason, TextDelta, ToolCallDelta

__all__ = ["read_tool_calls", "tools_to_show"]


def tools_to_show(request: GenerationRequest, *, renders_tools: bool) -> tuple[Tool, ...]:
    """The tools the model is shown (none unless the template renders them); raise
    :class:`~sluice.errors.InvalidParameterError` naming the first field of ``request``
    that the engine cannot honour (see the module doc)."""
    choice = request.tool_choice
    mode = None if choice is None else choice.mode
    tools = request.tools if mode is not ToolChoiceMode.NONE else ()
    if tools and not renders_tools:
        raise InvalidParameterError(
            "tools: this model cannot call tools: its chat template does not render them; "
            'send no tools (or tool_choice "none"), or serve a model whose template does',
            "tools",
        )
    if mode is ToolChoiceMode.REQUIRED or mode is ToolChoiceMode.FUNCTION:
        raise InvalidParameterError(
            f'tool_choice: "{mode}" cannot be honoured: the engine does not constrain its '
            'output to a tool call; use "auto" or "none"',
            "tool_choice",
        )
    response_format = request.response_format
    if response_format is not None and response_format.type != "text":
        raise InvalidParameterError(
            f"response_format: this model cannot constrain its output to {response_format.type}",
            "response_format",
        )
    if not renders_tools and any(message.tool_calls for message in request.messages or ()):
        raise InvalidParameterError(
            "messages: the history holds tool calls, and this model's chat template does not "
            "render them",
            "messages",
        )
    return tools


def read_tool_calls(
    parser: HermesToolCallParser,
    text: str,
    reason: FinishReason | None,
    *,
    finished: bool,
    stop_sequence: str | None = None,
) -> Delta:
    """New text of the answer (one engine output's, say) read for tool calls; at the end
    (``finished``) an answer that ended normally after one ends with ``tool_calls`` (a stop
    string then no longer names the end)."""
    events: list[TextDelta | ToolCallDelta] = parser.feed(text)
    if finished:
        events += parser.finish()
        if reason is FinishReason.STOP and parser.num_calls:
            reason, stop_sequence = FinishReason.TOOL_CALLS, None
    return Delta(events, reason, stop_sequence)
