"""What the OpenAI and Anthropic dialect tests share: sample events and the checks every
compatible dialect must pass (nothing after the terminal event, failures as status and body).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import pytest

from sluice.dialects.common import WholeResponse
from sluice.errors import ProtocolError
from sluice.events import Finished, FinishReason, NeutralEvent, Started, TextDelta, Usage

WEATHER = '{"city": "Paris", "unit": "c"}'
# A five-token prompt (known at admission, and reported again by ``Usage``), two tokens out.
HELLO: list[NeutralEvent] = [Started("m", 1700, 5), TextDelta("Hel"), TextDelta("lo"), Usage(5, 2)]

Whole = TypeVar("Whole", bound=WholeResponse)


def feed_all(acc: Whole, events: Sequence[NeutralEvent]) -> Whole:
    """``acc`` after every event was fed to it."""
    for event in events:
        acc.feed(event)
    return acc


def assert_renders_nothing_after(
    render: Callable[[NeutralEvent], object], terminal: NeutralEvent
) -> None:
    """After ``terminal``, every event raises ``ProtocolError`` rather than render."""
    render(terminal)
    for event in (TextDelta("late"), Usage(1, 1), Finished(FinishReason.STOP)):
        with pytest.raises(ProtocolError, match="after the terminal event"):
            render(event)


def assert_failed_with(acc: WholeResponse, status: int, body: dict[str, object]) -> None:
    """``acc`` reports ``(status, body)`` and has no result."""
    assert acc.error() == (status, body)
    with pytest.raises(ProtocolError, match="failed"):
        acc.result()


def assert_unfinished(acc: WholeResponse) -> None:
    """``acc`` has neither an error nor a result yet."""
    assert not acc.finished
    assert acc.error() is None
    with pytest.raises(ProtocolError, match="not finished"):
        acc.result()


def assert_refuses_after_terminal(acc: WholeResponse) -> None:
    with pytest.raises(ProtocolError, match="after the terminal event"):
        acc.feed(TextDelta("late"))
