"""A Hugging Face ``tokenizer.json`` (byte-level BPE) with the raw bytes of every token.

The engine detokenizes incrementally from bytes (see
:mod:`sluice.engine.detokenizer`), so this wrapper precomputes, once, each token's bytes:
byte-level BPE writes bytes as printable stand-in characters (GPT-2's ``bytes_to_unicode``
table), which are mapped back here; added (special) tokens are their UTF-8 text.

Encoding releases the GIL (``encode_batch_fast``; plain ``encode`` holds it for the whole
call, 90 ms for 200,000 characters), so a caller may run it on a worker thread while the
event loop goes on.

:meth:`Tokenizer.min_num_tokens` bounds a text's token count from below without encoding
it, so an oversized prompt is refused at once. The bound is ``ceil(utf8_bytes /
max_token_bytes)``: each token stands for at most ``max_token_bytes`` bytes of the text,
and every byte of the text is in some token. The second half holds only when nothing drops
or shrinks text before the BPE model: no normalizer (NFKC composes, ``Strip`` and
``Replace`` remove), a pre-tokenizer that only splits (``ByteLevel``, ``Split``, ``Digits``,
``Punctuation``, not with the ``removed`` behaviour, nor ``Whitespace``), every one of the
256 bytes in the vocabulary (BPE skips an unknown character when there is no unknown
token), and no added token that swallows the whitespace around it (``lstrip``/``rstrip``).
A tokenizer where that cannot be shown gets no bound (0): its prompts are always encoded.
Characters alone bound nothing useful: one token can stand for many characters, and a
normalizer can turn one character into many tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tokenizers

__all__ = ["Tokenizer", "TokenizerError"]

# Special tokens that end a document in GPT-2-style vocabularies, in order of preference.
_EOS_TOKENS = ("<|endoftext|>", "</s>", "<eos>")


class TokenizerError(ValueError):
    """A tokenizer file that cannot be used (missing, malformed, not byte-level)."""


def _byte_decoder() -> dict[str, int]:
    """GPT-2's stand-in character for each byte, reversed (character -> byte)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), ord("\u00ff") + 1),
    ]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(char): byte for byte, char in zip(printable, chars, strict=True)}


# Pre-tokenizers that split text without dropping any of it (unless told to remove).
_SPLITTING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Split", "Digits", "Punctuation"})


def _keeps_every_byte(spec: Any) -> bool:
    """Whether a ``pre_tokenizer`` of ``tokenizer.json`` passes every byte of its input on."""
    if spec is None:
        return True
    if not isinstance(spec, dict):
        return False
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_keeps_every_byte(part) for part in spec.get("pretokenizers", []))
    return kind in _SPLITTING_PRE_TOKENIZERS and spec.get("behavior") != "Removed"


class Tokenizer:
    """Encodes text to token ids; gives each token's raw bytes."""

    def __init__(self, tokenizer: tokenizers.Tokenizer) -> None:
        self._tokenizer = tokenizer
        byte_of = _byte_decoder()
        special = {token.content for token in tokenizer.get_added_tokens_decoder().values()}
        vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        table: list[bytes] = []
        for token_id in range(vocab_size):
            text = tokenizer.id_to_token(token_id)
            if text is None:
                table.append(b"")
            elif text in special:
                table.append(text.encode())
            else:
                try:
                    table.append(bytes(byte_of[char] for char in text))
                except KeyError:
                    raise TokenizerError(
                        f"token {token_id} ({text!r}) is not byte-level BPE"
                    ) from None
        self._token_bytes = table
        self.max_token_bytes = max((len(b) for b in table), default=0)
        self._bounds_tokens = self.max_token_bytes > 0 and _covers_every_byte(
            tokenizer, table, special_tokens=tokenizer.get_added_tokens_decoder().values()
        )
        self.eos_token_id: int | None = None
        for name in _EOS_TOKENS:
            eos_id = tokenizer.token_to_id(name)
            if eos_id is not None:
                self.eos_token_id = eos_id
                break

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        try:
            tokenizer = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # the library raises plain Exception for bad files
            raise TokenizerError(f"cannot read tokenizer {path}: {exc}") from exc
        return cls(tokenizer)

    @property
    def vocab_size(self) -> int:
        return len(self._token_bytes)

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text`` (no special tokens added); releases the GIL."""
        ids: list[int] = self._tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids
        return ids

    def min_num_tokens(self, text: str) -> int:
        """A lower bound of ``len(self.encode(text))``, in time linear in ``len(text)`` with
        no encoding: 0 when this tokenizer's pipeline could drop text (see the module)."""
        if not self._bounds_tokens:
            return 0
        num_bytes = len(text.encode("utf-8", "surrogatepass"))
        return -(-num_bytes // self.max_token_bytes)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes token ``token_id`` stands for (``b""`` for an unknown id)."""
        if 0 <= token_id < len(self._token_bytes):
            return self._token_bytes[token_id]
        return b""


def _covers_every_byte(
    tokenizer: tokenizers.Tokenizer,
    table: list[bytes],
    *,
    special_tokens: Any,
) -> bool:
    """Whether every byte of a text ends up in one of its tokens (see the module)."""
    spec = json.loads(tokenizer.to_str())
    if spec.get("normalizer") is not None or not _keeps_every_byte(spec.get("pre_tokenizer")):
        return False
    if any(token.lstrip or token.rstrip for token in special_tokens):
        return False
    return len({b for b in table if len(b) == 1}) == 256
