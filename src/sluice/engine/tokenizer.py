"""A Hugging Face ``tokenizer.json`` (byte-level BPE) with the raw bytes of every token.

The engine detokenizes incrementally from bytes (see
:mod:`sluice.engine.detokenizer`), so this wrapper precomputes, once, each token's bytes:
byte-level BPE writes bytes as printable stand-in characters (GPT-2's ``bytes_to_unicode``
table), which are mapped back here; added tokens that are not special (``<think>``) are
their UTF-8 text, and special tokens (``<|endoftext|>``, ``<|im_end|>``) are no bytes at all:
they are never rendered into output text, whether they end the generation or not (vLLM's
``skip_special_tokens`` default).

The checkpoint's loader says which ids end a generation (``eos_token_ids``: every EOS of
its config files) and whether a prompt starts with BOS (``add_bos_token``); :meth:`encode`
then puts ``bos_token_id`` first unless the prompt (a chat template's, say) already did.

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
from collections.abc import Sequence
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

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        eos_token_ids: Sequence[int] | None = None,
        bos_token_id: int | None = None,
        add_bos_token: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        byte_of = _byte_decoder()
        added = tokenizer.get_added_tokens_decoder().values()
        special = {token.content for token in added if token.special}
        plain = {token.content for token in added if not token.special}
        vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        table: list[bytes] = []
        for token_id in range(vocab_size):
            text = tokenizer.id_to_token(token_id)
            if text is None or text in special:
                table.append(b"")
            elif text in plain:
                table.append(text.encode())
            else:
                try:
                    table.append(bytes(byte_of[char] for char in text))
                except KeyError:
                    raise TokenizerError(
                        f"token {token_id} ({text!r}) is not byte-level BPE"
                    ) from None
        self._token_bytes = table
        # The most text one token stands for: a special token is no output, but its name in
        # a prompt is one token (the bound of min_num_tokens).
        self.max_token_bytes = max(
            (*(len(b) for b in table), *(len(text.encode()) for text in special)), default=0
        )
        self._bounds_tokens = self.max_token_bytes > 0 and _covers_every_byte(
            tokenizer, table, special_tokens=tokenizer.get_added_tokens_decoder().values()
        )
        # Ids past the vocabulary are dropped: config files carry defaults of other models
        # (transformers' GPT2Config writes 50256 whatever the vocabulary).
        eos_token_ids = [i for i in eos_token_ids or () if 0 <= i < vocab_size]
        if not eos_token_ids:  # none given: the first of the usual names there is
            found = [tokenizer.token_to_id(name) for name in _EOS_TOKENS]
            eos_token_ids = [i for i in found if i is not None][:1]
        if bos_token_id is not None and not 0 <= bos_token_id < vocab_size:
            bos_token_id = None
        add_bos_token = add_bos_token and bos_token_id is not None
        # Every id that ends a generation; eos_token_id is the first (the tokenizer's own).
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))
        self.eos_token_id: int | None = self.eos_token_ids[0] if self.eos_token_ids else None
        self.bos_token_id = bos_token_id
        self.add_bos_token = add_bos_token

    @classmethod
    def from_file(
        cls,
        path: str | Path,
        *,
        eos_token_ids: Sequence[int] | None = None,
        bos_token_id: int | None = None,
        add_bos_token: bool = False,
    ) -> Tokenizer:
        try:
            tokenizer = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # the library raises plain Exception for bad files
            raise TokenizerError(f"cannot read tokenizer {path}: {exc}") from exc
        return cls(
            tokenizer,
            eos_token_ids=eos_token_ids,
            bos_token_id=bos_token_id,
            add_bos_token=add_bos_token,
        )

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The ``tokenizers`` object underneath (its vocabulary and special tokens)."""
        return self._tokenizer

    def token_id(self, text: str) -> int | None:
        """The id of the token spelled ``text`` (a special token's name), if there is one."""
        token_id: int | None = self._tokenizer.token_to_id(text)
        return token_id

    def token_text(self, token_id: int) -> str:
        """How the vocabulary spells token ``token_id`` (``""`` for an unknown id)."""
        return self._tokenizer.id_to_token(token_id) or ""

    @property
    def vocab_size(self) -> int:
        return len(self._token_bytes)

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text``, BOS first when the model wants it and ``text`` does not
        already start with it (no other special tokens added); releases the GIL."""
        ids: list[int] = self._tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids
        bos = self.bos_token_id
        if self.add_bos_token and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
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
