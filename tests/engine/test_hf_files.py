"""A Hugging Face checkpoint's side files: chat template, every EOS id, BOS only when asked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers
from tokenizers import processors

from sluice.engine.hf_files import HFFilesError, read_chat_template, read_special_tokens
from sluice.engine.tokenizer import Tokenizer
from tests.tiny_tokenizer import train_tokenizer

SPECIAL = ["<s>", "</s>", "<|im_end|>", "<|eot|>"]


@pytest.fixture
def backend(tmp_path: Path) -> tokenizers.Tokenizer:
    train_tokenizer(tmp_path / "tokenizer.json", ["Streams of tokens arrive one by one."] * 20)
    tokenizer = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    tokenizer.add_special_tokens(SPECIAL)
    return tokenizer


def _write(directory: Path, name: str, value: object) -> None:
    (directory / name).write_text(json.dumps(value) if not isinstance(value, str) else value)


def test_chat_template_jinja_wins_over_tokenizer_config(tmp_path: Path) -> None:
    assert read_chat_template(tmp_path) is None
    _write(tmp_path, "tokenizer_config.json", {"chat_template": "old"})
    assert read_chat_template(tmp_path) == "old"
    _write(tmp_path, "chat_template.jinja", "{{ messages[0].content }}")
    assert read_chat_template(tmp_path) == "{{ messages[0].content }}"


def test_a_list_of_named_templates_gives_the_default_one(tmp_path: Path) -> None:
    templates = [{"name": "tool_use", "template": "t"}, {"name": "default", "template": "d"}]
    _write(tmp_path, "tokenizer_config.json", {"chat_template": templates})
    assert read_chat_template(tmp_path) == "d"


def test_every_eos_of_every_config_file_is_a_stop(
    tmp_path: Path, backend: tokenizers.Tokenizer
) -> None:
    ids = {token: backend.token_to_id(token) for token in SPECIAL}
    _write(tmp_path, "generation_config.json", {"eos_token_id": [ids["</s>"], ids["<|eot|>"]]})
    _write(tmp_path, "config.json", {"eos_token_id": ids["</s>"], "bos_token_id": ids["<s>"]})
    _write(tmp_path, "tokenizer_config.json", {"eos_token": {"content": "<|im_end|>"}})
    special = read_special_tokens(tmp_path, backend)
    assert special.eos_token_ids == (ids["</s>"], ids["<|eot|>"], ids["<|im_end|>"])
    assert special.eos_token == "<|im_end|>"
    assert (special.bos_token_id, special.bos_token) == (ids["<s>"], "<s>")
    assert not special.add_bos_token  # nothing says so
    tokenizer = Tokenizer(backend, eos_token_ids=special.eos_token_ids)
    assert tokenizer.eos_token_ids == special.eos_token_ids
    assert all(tokenizer.token_bytes(i) == b"" for i in special.eos_token_ids)


def test_an_eos_list_that_is_not_ids_is_refused_by_file(
    tmp_path: Path, backend: tokenizers.Tokenizer
) -> None:
    _write(tmp_path, "generation_config.json", {"eos_token_id": ["</s>"]})
    with pytest.raises(HFFilesError, match=r"generation_config\.json"):
        read_special_tokens(tmp_path, backend)


def test_bos_is_added_when_the_tokenizer_config_says_so_and_never_twice(
    tmp_path: Path, backend: tokenizers.Tokenizer
) -> None:
    _write(tmp_path, "tokenizer_config.json", {"bos_token": "<s>", "add_bos_token": True})
    special = read_special_tokens(tmp_path, backend)
    assert special.add_bos_token
    tokenizer = Tokenizer(backend, bos_token_id=special.bos_token_id, add_bos_token=True)
    bos = backend.token_to_id("<s>")
    plain = backend.encode("Streams of", add_special_tokens=False).ids
    assert tokenizer.encode("Streams of") == [bos, *plain]
    assert tokenizer.encode("<s>Streams of") == [bos, *plain]  # a template that writes it
    assert tokenizer.encode("") == [bos]


def test_bos_follows_the_post_processor_when_the_config_is_silent(
    tmp_path: Path, backend: tokenizers.Tokenizer
) -> None:
    _write(tmp_path, "tokenizer_config.json", {"bos_token": "<s>"})
    assert not read_special_tokens(tmp_path, backend).add_bos_token  # GPT-2 style: none
    bos = backend.token_to_id("<s>")
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )  # Llama 3 style
    assert read_special_tokens(tmp_path, backend).add_bos_token
