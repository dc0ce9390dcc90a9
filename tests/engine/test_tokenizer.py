"""The tokenizer: the same ids as the library, a lower bound of a text's token count that
is never above the real count (and none where the pipeline could drop text), and an encode
that lets other threads run."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.cli import BUNDLED_MODEL
from sluice.engine.tokenizer import Tokenizer

BUNDLED_TOKENIZER = BUNDLED_MODEL / "tokenizer.json"
TEXTS = [
    "",
    "The quick brown fox",
    "café 東京 🙂 <|endoftext|> and more<|endoftext|><|endoftext|>",
    "\n" + " " * 40 + "=" * 100 + "-" * 19 + "+",
    "\x00\x01\x7f\ud7ff\ue000\U0010ffff",
]


@pytest.fixture(scope="module")
def bundled() -> Tokenizer:
    return Tokenizer.from_file(BUNDLED_TOKENIZER)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_gives_the_library_s_ids(bundled: Tokenizer, text: str) -> None:
    library = tokenizers.Tokenizer.from_file(str(BUNDLED_TOKENIZER))
    assert bundled.encode(text) == library.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("text", TEXTS)
def test_the_token_bound_holds_on_hard_texts(bundled: Tokenizer, text: str) -> None:
    """The longest tokens (runs of '=' and spaces) and a special token's 13 characters."""
    assert bundled.min_num_tokens(text) <= len(bundled.encode(text))


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_the_token_bound_is_never_above_the_token_count(text: str) -> None:
    tokenizer = Tokenizer.from_file(BUNDLED_TOKENIZER)
    assert tokenizer.min_num_tokens(text) <= len(tokenizer.encode(text))


def test_the_bound_refuses_a_prompt_far_over_the_context(bundled: Tokenizer) -> None:
    """The bundled model's context is 256 tokens; its longest token has 32 bytes."""
    assert bundled.max_token_bytes == 32
    assert bundled.min_num_tokens("xq " * 66_000) == 6188  # ceil(198,000 / 32)


def rewritten(tmp_path: Path, change: str) -> Tokenizer:
    """The bundled tokenizer with one change to its pipeline."""
    spec = json.loads(BUNDLED_TOKENIZER.read_text("utf-8"))
    if change == "normalizer":
        spec["normalizer"] = {"type": "NFKC"}
    elif change == "whitespace pre-tokenizer":
        spec["pre_tokenizer"] = {
            "type": "Sequence",
            "pretokenizers": [{"type": "WhitespaceSplit"}, spec["pre_tokenizer"]],
        }
    elif change == "split that removes":
        spec["pre_tokenizer"] = {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"String": "x"},
                    "behavior": "Removed",
                    "invert": False,
                },
                spec["pre_tokenizer"],
            ],
        }
    elif change == "stripping added token":
        spec["added_tokens"][0]["lstrip"] = True
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec), "utf-8")
    return Tokenizer.from_file(path)


@pytest.mark.parametrize(
    "change",
    ["normalizer", "whitespace pre-tokenizer", "split that removes", "stripping added token"],
)
def test_no_bound_where_the_pipeline_could_drop_text(tmp_path: Path, change: str) -> None:
    """Each of these can make a text's tokens fewer than its bytes over the longest token's
    (NFKC composes characters; a whitespace split or a removing split drops text; an
    lstrip token swallows the spaces before it)."""
    tokenizer = rewritten(tmp_path, change)
    assert tokenizer.min_num_tokens("xq " * 10_000) == 0
    spaces = " " * 5000 + "<|endoftext|>"
    assert tokenizer.min_num_tokens(spaces) <= len(tokenizer.encode(spaces))


def test_the_split_pre_tokenizers_that_keep_text_keep_the_bound(tmp_path: Path) -> None:
    spec = json.loads(BUNDLED_TOKENIZER.read_text("utf-8"))
    spec["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "Punctuation", "behavior": "Isolated"},
            spec["pre_tokenizer"],
        ],
    }
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec), "utf-8")
    assert Tokenizer.from_file(path).min_num_tokens("xq " * 100) > 0


def main_thread_gap_s(tokenizer: Tokenizer, text: str) -> tuple[float, float]:
    """Encode ``text`` on a thread while this one ticks: (encode seconds, longest tick)."""
    done = threading.Event()
    took: list[float] = []

    def encode() -> None:
        started = time.perf_counter()
        tokenizer.encode(text)
        took.append(time.perf_counter() - started)
        done.set()

    worker = threading.Thread(target=encode)
    last = time.perf_counter()
    longest = 0.0
    worker.start()
    while not done.is_set():
        now = time.perf_counter()
        longest = max(longest, now - last)
        last = now
        done.wait(0.001)
    worker.join()
    return took[0], longest


def test_encoding_lets_other_threads_run(bundled: Tokenizer) -> None:
    """A GIL held through the encode would stop this thread for all of it (about 100 ms
    for 198,000 characters); released, this thread ticks on. Systematic against random:
    one of three tries must tick with no gap of half the encode."""
    text = "xq " * 66_000
    tries = [main_thread_gap_s(bundled, text) for _ in range(3)]
    assert any(gap < took / 2 for took, gap in tries), tries
