"""A Hugging Face ``tokenizer.json`` (byte-level BPE) with the raw bytes of every token.

The engine detokenizes incrementally from bytes (see
:mod:`sluice.engine.detokenizer`), so this wrapper precomputes, once, each token's bytes:
byte-level BPE writes bytes as printable stand-in characters (GPT-2's ``bytes_to_unicode``
table), which are mapped back here; added (special) tokens are their UTF-8 text.
"""

from __future__ import annotations

from pathlib import Path

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
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=False).ids
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes token ``token_id`` stands for (``b""`` for an unknown id)."""
        if 0 <= token_id < len(self._token_bytes):
            return self._token_bytes[token_id]
        return b""
