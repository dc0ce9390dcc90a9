"""Incremental detokenization: UTF-8 safe, stop strings caught across tokens, never leaked."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sluice.engine.detokenizer import IncrementalDetokenizer


def run(pieces: list[bytes], stop: tuple[str, ...] = ()) -> tuple[list[str], str | None]:
    detokenizer = IncrementalDetokenizer(stop)
    out = [detokenizer.push(piece) for piece in pieces]
    out.append(detokenizer.flush())
    return out, detokenizer.stop


def test_a_character_split_across_tokens_is_released_whole() -> None:
    snowman = "☃".encode()  # three bytes
    out, _ = run([b"a", snowman[:1], snowman[1:2], snowman[2:] + b"b"])
    assert out == ["a", "", "", "☃b", ""]
    assert "\ufffd" not in "".join(out)


def test_an_unfinished_character_at_the_very_end_becomes_one_replacement() -> None:
    out, _ = run([b"ok", "€".encode()[:2]])
    assert "".join(out) == "ok\ufffd"


def test_a_stop_string_split_across_tokens_is_caught_and_not_leaked() -> None:
    out, stop = run([b"Hello wor", b"ld. EN", b"D and more", b"never"], stop=("END",))
    assert "".join(out) == "Hello world. "
    assert stop == "END"
    assert out[1] == "ld. "  # "EN" was held back: it could have been the start of "END"


def test_held_text_that_turns_out_not_to_be_a_stop_is_released() -> None:
    out, stop = run([b"the E", b"ND", b"x"], stop=("ENDS",))
    assert out == ["the ", "", "ENDx", ""]  # released as soon as it cannot match
    assert stop is None


def test_the_earliest_of_several_stop_strings_wins() -> None:
    out, stop = run([b"a STOP b HALT c"], stop=("HALT", "STOP"))
    assert "".join(out) == "a "
    assert stop == "STOP"


def test_nothing_is_released_after_a_stop() -> None:
    detokenizer = IncrementalDetokenizer(("!",))
    assert detokenizer.push(b"hi!") == "hi"
    assert detokenizer.push(b"more") == ""
    assert detokenizer.flush() == ""


def test_empty_stop_strings_are_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        IncrementalDetokenizer(("",))


def split_bytes(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces, start = [], 0
    for point in [*points, len(data)]:
        pieces.append(data[start:point])
        start = point
    return pieces


@given(st.text(), st.lists(st.integers(min_value=0), max_size=20))
def test_any_split_of_any_text_round_trips_without_replacement(text: str, cuts: list[int]) -> None:
    out, _ = run(split_bytes(text.encode(), cuts))
    assert "".join(out) == text


@given(
    st.text(alphabet="abE N\u00e9\u2603", max_size=40),
    st.sampled_from(["END", "N\u00e9", "\u2603\u2603"]),
    st.text(alphabet="abE N\u00e9\u2603", max_size=10),
    st.lists(st.integers(min_value=0), max_size=12),
)
def test_output_is_the_text_up_to_the_first_stop_whatever_the_split(
    before: str, stop: str, after: str, cuts: list[int]
) -> None:
    text = before + stop + after
    out, matched = run(split_bytes(text.encode(), cuts), stop=(stop,))
    assert "".join(out) == text[: text.find(stop)]
    assert matched == stop
