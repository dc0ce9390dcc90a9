"""Stream ids and event ids."""

from __future__ import annotations

import pytest

from sluice.errors import BadEventIdError
from sluice.streams.ids import event_id, is_stream_id, new_stream_id, parse_event_id


def test_new_stream_ids_are_well_formed_and_distinct() -> None:
    ids = {new_stream_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(is_stream_id(i) and len(i) == 26 for i in ids)


def test_event_id_round_trips() -> None:
    sid = new_stream_id()
    assert parse_event_id(event_id(sid, 42)) == (sid, 42)
    assert parse_event_id(f"{sid}:0") == (sid, 0)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "str_abc:1",
        "nonsense",
        f"{'str_' + 'a' * 22}",
        f"{'str_' + 'a' * 22}:",
        f"{'str_' + 'a' * 22}:-1",
        f"{'str_' + 'a' * 22}:01",
        f"{'str_' + 'a' * 22}:1 ",
        f"{'str_' + 'a' * 22}:1x",
        f"{'str_' + 'a' * 22}:{'9' * 40}",
        "x" * 10_000,
    ],
)
def test_malformed_event_ids_are_refused(text: str) -> None:
    with pytest.raises(BadEventIdError):
        parse_event_id(text)
