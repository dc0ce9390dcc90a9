"""A model's tokenizer, chat template and special tokens as a ZIP of Hugging Face files.

``GetTokenizer`` streams this archive from a worker to whoever fronts it: Sluice's gateway,
or a router of vLLM's ecosystem (smg reads the same layout). The gRPC protocol carries
token ids only, so the front tokenizes prompts, renders chat templates and detokenizes
with what it got here. The worker writes the archive from the model it serves (its loaded
:class:`~sluice.engine.loader.Checkpoint`), not from the model's directory, so a GGUF
model's tokenizer, rebuilt from the file's metadata, travels the same way:

- ``tokenizer.json``: the tokenizer as ``tokenizers`` writes it;
- ``tokenizer_config.json``: ``bos_token``, ``eos_token``, ``add_bos_token``,
  ``model_max_length`` and, for readers older than transformers 5, ``chat_template``;
- ``chat_template.jinja``, when the model has a template (transformers 5's layout);
- ``generation_config.json``: ``eos_token_id`` (every id that ends a generation) and
  ``bos_token_id``.

:func:`read_bundle` reads it back with the loader's own readers
(:mod:`sluice.engine.hf_files`, :class:`~sluice.engine.tokenizer.Tokenizer`), so the
gateway encodes, renders and decodes exactly as the worker's engine would in-process.

Bounds: an archive is at most :data:`MAX_BUNDLE_BYTES` packed and
:data:`MAX_UNPACKED_BYTES` unpacked, and only the names above are read from it.
"""

from __future__ import annotations

import io
import json
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from sluice.engine.hf_files import HFFilesError, read_chat_template, read_special_tokens
from sluice.engine.tokenizer import Tokenizer, TokenizerError

__all__ = [
    "MAX_BUNDLE_BYTES",
    "MAX_UNPACKED_BYTES",
    "ModelFiles",
    "TokenizerBundleError",
    "read_bundle",
    "write_bundle",
]

# The largest tokenizer.json files of real models are tens of MB (deflated to a third).
MAX_BUNDLE_BYTES: Final = 64 << 20
MAX_UNPACKED_BYTES: Final = 256 << 20
_ZIP_DATE: Final = (1980, 1, 1, 0, 0, 0)
_NAMES: Final = frozenset(
    {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"}
)


class TokenizerBundleError(ValueError):
    """An archive that is not a usable tokenizer bundle; the message says why."""


@dataclass(frozen=True, slots=True)
class ModelFiles:
    """What a front needs of a model to make its prompts and read its tokens."""

    tokenizer: Tokenizer
    chat_template: str | None
    bos_token: str = ""
    eos_token: str = ""


def write_bundle(files: ModelFiles, max_model_len: int) -> bytes:
    """The archive of ``files`` (see the module), deflated; the same files make the same
    bytes, so two workers of one model show the same SHA-256."""
    tokenizer = files.tokenizer
    config: dict[str, object] = {
        "bos_token": files.bos_token or None,
        "eos_token": files.eos_token or None,
        "add_bos_token": tokenizer.add_bos_token,
        "model_max_length": max_model_len,
    }
    if files.chat_template is not None:
        config["chat_template"] = files.chat_template
    generation: dict[str, object] = {"eos_token_id": list(tokenizer.eos_token_ids)}
    if tokenizer.bos_token_id is not None:
        generation["bos_token_id"] = tokenizer.bos_token_id
    members = {
        "tokenizer.json": tokenizer.backend.to_str(),
        "tokenizer_config.json": json.dumps(config, ensure_ascii=False),
        "generation_config.json": json.dumps(generation),
    }
    if files.chat_template is not None:
        members["chat_template.jinja"] = files.chat_template
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, text in members.items():
            # A fixed date: the same model makes the same bytes (and SHA-256) everywhere.
            info = zipfile.ZipInfo(name, date_time=_ZIP_DATE)
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, text)
    return buffer.getvalue()


def read_bundle(data: bytes) -> ModelFiles:
    """The tokenizer, template and special tokens of an archive :func:`write_bundle` made
    (or any archive of those Hugging Face files); raises :class:`TokenizerBundleError`."""
    if len(data) > MAX_BUNDLE_BYTES:
        raise TokenizerBundleError(f"the archive is over {MAX_BUNDLE_BYTES} bytes")
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile as exc:
        raise TokenizerBundleError(f"not a ZIP archive: {exc}") from exc
    with archive, tempfile.TemporaryDirectory(prefix="sluice-tokenizer-") as temporary:
        members = [info for info in archive.infolist() if info.filename in _NAMES]
        if sum(info.file_size for info in members) > MAX_UNPACKED_BYTES:
            raise TokenizerBundleError(f"the archive unpacks to over {MAX_UNPACKED_BYTES} bytes")
        if "tokenizer.json" not in {info.filename for info in members}:
            raise TokenizerBundleError("the archive holds no tokenizer.json")
        directory = Path(temporary)
        try:
            for info in members:  # known flat names only: nothing lands outside the folder
                (directory / info.filename).write_bytes(archive.read(info))
            backend = Tokenizer.from_file(directory / "tokenizer.json").backend
            special = read_special_tokens(directory, backend)
            template = read_chat_template(directory)
        except (OSError, zipfile.BadZipFile, HFFilesError, TokenizerError) as exc:
            raise TokenizerBundleError(str(exc)) from exc
    try:
        tokenizer = Tokenizer(
            backend,
            eos_token_ids=special.eos_token_ids,
            bos_token_id=special.bos_token_id,
            add_bos_token=special.add_bos_token,
        )
    except TokenizerError as exc:
        raise TokenizerBundleError(str(exc)) from exc
    return ModelFiles(tokenizer, template, special.bos_token, special.eos_token)
