"""A GGUF file's tokenizer, rebuilt from its ``tokenizer.ggml.*`` metadata.

A GGUF has no ``tokenizer.json``; llama.cpp stores the vocabulary (``tokens``, in the
byte-level alphabet for BPE), the ``merges``, each token's ``token_type`` and the special
token ids. For ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE: GPT-2, Llama 3, SmolLM,
Qwen ...) this builds the same ``tokenizers`` pipeline Hugging Face would: a BPE model over
those tokens and merges, the pre-tokenizer that ``tokenizer.ggml.pre`` names (llama.cpp's
``llama-vocab.cpp`` lists the split rules per name), a byte-level decoder, and the tokens
marked CONTROL (3) as special, USER_DEFINED (4) as plain added tokens, so both stay whole.

End of generation: ``eos_token_id`` and, where present, ``eot_token_id`` and
``eom_token_id`` (Llama 3's ``<|eot_id|>``, ``<|eom_id|>``). BOS is added to a prompt only
when ``tokenizer.ggml.add_bos_token`` is true.

Divergences, each deliberate:

1. ``pre = "smollm"`` (and llama.cpp's other StarCoder-style names) splits digits one by one
   before the GPT-2 split, as llama.cpp and SmolLM's own ``tokenizer.json`` do;
   ``transformers`` 5.23's GGUF loader leaves the digits out, so its ids differ from ours on
   text with multi-digit numbers.
2. SentencePiece vocabularies (``model = "llama"``: Llama 2, Mistral, TinyLlama) and
   pre-tokenizer names not listed here are refused; a ``tokenizer.json`` beside the file is
   used instead when there is one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from sluice.engine.gguf_file import GGUFError, MetadataValue

__all__ = ["GGUFSpecialTokens", "gguf_special_tokens", "gguf_tokenizer"]

_CONTROL = 3
_USER_DEFINED = 4

# llama.cpp's LLAMA3 split (also its dbrx, smaug-bpe), as in the Llama 3 tokenizer.json.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_NAMES = frozenset({"default", "gpt2", "gpt-2"})
_DIGITS_THEN_GPT2_NAMES = frozenset(
    {"smollm", "starcoder", "refact", "codeshell", "exaone", "minerva-7b", "command-r"}
)
_LLAMA3_NAMES = frozenset({"llama3", "llama-v3", "llama-bpe", "dbrx", "smaug-bpe", "falcon3"})


@dataclass(frozen=True)
class GGUFSpecialTokens:
    """The special token ids of a GGUF file."""

    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    add_bos_token: bool


def _strings(metadata: dict[str, MetadataValue], key: str) -> list[str]:
    value = metadata.get(key)
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise GGUFError(f"metadata {key} is missing or not a list of strings")
    return value  # type: ignore[return-value]


def _pre_tokenizer(name: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name in _GPT2_NAMES:
        return byte_level
    if name in _DIGITS_THEN_GPT2_NAMES:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if name in _LLAMA3_NAMES:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    known = sorted(_GPT2_NAMES | _DIGITS_THEN_GPT2_NAMES | _LLAMA3_NAMES)
    raise GGUFError(
        f"tokenizer.ggml.pre {name!r} is not supported (supported: {', '.join(known)}); "
        "put the model's tokenizer.json beside the file"
    )


def gguf_tokenizer(metadata: dict[str, MetadataValue]) -> tokenizers.Tokenizer:
    """The byte-level BPE tokenizer the metadata describes (see the module)."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(
            f"tokenizer.ggml.model {kind!r} is not supported (only 'gpt2', byte-level BPE); "
            "put the model's tokenizer.json beside the file"
        )
    pre = metadata.get("tokenizer.ggml.pre", "default")
    pre_tokenizer = _pre_tokenizer(str(pre))
    tokens = _strings(metadata, "tokenizer.ggml.tokens")
    merges = _strings(metadata, "tokenizer.ggml.merges")
    pairs: list[tuple[str, str]] = []
    for merge in merges:
        left, space, right = merge.partition(" ")
        if not space:
            raise GGUFError(f"merge {merge!r} is not two tokens")
        pairs.append((left, right))
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = tokenizers.Tokenizer(models.BPE(vocab, pairs, fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    types = metadata.get("tokenizer.ggml.token_type")
    if isinstance(types, list) and len(types) == len(tokens):
        _add_tokens(tokenizer, tokens, types)  # type: ignore[arg-type]
    return tokenizer


def _add_tokens(tokenizer: tokenizers.Tokenizer, tokens: list[str], types: Sequence[int]) -> None:
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, kind in zip(tokens, types, strict=True)
        if kind == _CONTROL
    ]
    user = [
        AddedToken(token, normalized=False, special=False)
        for token, kind in zip(tokens, types, strict=True)
        if kind == _USER_DEFINED
    ]
    if control:
        tokenizer.add_special_tokens(control)
    if user:
        tokenizer.add_tokens(user)


def gguf_special_tokens(metadata: dict[str, MetadataValue], vocab_size: int) -> GGUFSpecialTokens:
    """BOS, the end-of-generation ids and whether prompts start with BOS (see the module)."""

    def token_id(key: str) -> int | None:
        value = metadata.get(key)
        if value is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < vocab_size:
            raise GGUFError(f"metadata {key} is {value!r}, not a token id")
        return value

    eos = [token_id(f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot", "eom")]
    add_bos = metadata.get("tokenizer.ggml.add_bos_token", False)
    return GGUFSpecialTokens(
        bos_token_id=token_id("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(i for i in eos if i is not None)),
        add_bos_token=add_bos is True,
    )
