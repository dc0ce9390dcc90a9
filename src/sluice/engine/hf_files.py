"""What a Hugging Face checkpoint says beside its weights: chat template and special tokens.

Read as ``transformers`` 5 writes a checkpoint, and as older versions did:

- the chat template: ``chat_template.jinja`` (transformers 5), else ``chat_template`` in
  ``tokenizer_config.json`` (a string, or a list of named templates: the one named
  ``default``);
- the ids that end a generation: every ``eos_token_id`` of ``generation_config.json`` and
  ``config.json`` (a single id or a list), and the id of ``tokenizer_config.json``'s
  ``eos_token``; none at all leaves the tokenizer's own guess;
- BOS: ``tokenizer_config.json``'s ``bos_token`` (else ``bos_token_id`` of the configs),
  put before a prompt only when ``add_bos_token`` says so, or, when the tokenizer config does
  not say, when ``tokenizer.json``'s post-processor adds it (Llama 3's does, GPT-2's not);
- ``bos_token`` / ``eos_token`` as text, for templates that write them.

A file that is there but malformed raises :class:`HFFilesError` naming it; one that is
absent is no error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import tokenizers

__all__ = ["HFFilesError", "HFSpecialTokens", "read_chat_template", "read_special_tokens"]


class HFFilesError(ValueError):
    """A checkpoint side file that is there but cannot be used."""


@dataclass(frozen=True)
class HFSpecialTokens:
    eos_token_ids: tuple[int, ...] | None  # None: none declared
    bos_token_id: int | None
    add_bos_token: bool
    bos_token: str
    eos_token: str


def _json(path: Path) -> dict[str, object]:
    try:
        value = json.loads(path.read_text("utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HFFilesError(f"{path}: {exc}") from exc
    if not isinstance(value, dict):
        raise HFFilesError(f"{path}: not a JSON object")
    return value


def read_chat_template(directory: Path) -> str | None:
    """The checkpoint's chat template source, or None when it has none."""
    path = directory / "chat_template.jinja"
    try:
        return path.read_text("utf-8")
    except FileNotFoundError:
        pass
    except (OSError, UnicodeDecodeError) as exc:
        raise HFFilesError(f"{path}: {exc}") from exc
    source = _json(directory / "tokenizer_config.json").get("chat_template")
    if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
        named = {
            item.get("name"): item.get("template") for item in source if isinstance(item, dict)
        }
        source = named.get("default")
    return source if isinstance(source, str) else None


def _token_text(config: dict[str, object], name: str) -> str | None:
    value = config.get(name)
    if isinstance(value, dict):  # {"content": "<|im_end|>", "special": true, ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: object, where: str) -> list[int]:
    items = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(item, int) and not isinstance(item, bool) for item in items):
        raise HFFilesError(f"{where}: eos_token_id {value!r} is not an id or a list of ids")
    return items  # type: ignore[return-value]


def read_special_tokens(directory: Path, tokenizer: tokenizers.Tokenizer) -> HFSpecialTokens:
    """The special tokens the checkpoint's config files declare (see the module)."""
    generation = _json(directory / "generation_config.json")
    config = _json(directory / "config.json")
    tokenizer_config = _json(directory / "tokenizer_config.json")
    eos: list[int] = []
    for name, source in (("generation_config.json", generation), ("config.json", config)):
        eos += _ids(source.get("eos_token_id"), str(directory / name))
    eos_text = _token_text(tokenizer_config, "eos_token")
    if eos_text is not None and (eos_id := tokenizer.token_to_id(eos_text)) is not None:
        eos.append(eos_id)
    bos_text = _token_text(tokenizer_config, "bos_token")
    bos_id = None if bos_text is None else tokenizer.token_to_id(bos_text)
    for source in (generation, config):
        declared = source.get("bos_token_id")
        if bos_id is None and isinstance(declared, int) and not isinstance(declared, bool):
            bos_id = declared
    add_bos = tokenizer_config.get("add_bos_token")
    if not isinstance(add_bos, bool):  # the tokenizer's post-processor decides
        added = tokenizer.encode("", add_special_tokens=True).ids
        add_bos = bos_id is not None and added[:1] == [bos_id]
    if bos_text is None and bos_id is not None:
        bos_text = tokenizer.id_to_token(bos_id)
    if eos_text is None and eos:
        eos_text = tokenizer.id_to_token(eos[0])
    return HFSpecialTokens(
        eos_token_ids=tuple(dict.fromkeys(eos)) or None,
        bos_token_id=bos_id,
        add_bos_token=add_bos and bos_id is not None,
        bos_token=bos_text or "",
        eos_token=eos_text or "",
    )
