"""llama.cpp's ``convert_hf_to_gguf.py``, told that an unknown BPE pre-tokenizer is GPT-2's.

The converter names a BPE tokenizer's pre-tokenizer by hashing the token ids of a fixed check
text, and those ids depend on the vocabulary and merges: any custom vocabulary, such as
``models/sluice-tiny``'s 4,096-token BPE, has a hash it has never seen, and it stops with
``NotImplementedError: BPE pre-tokenizer was not recognized``, although that tokenizer's
pre-tokenizer (``ByteLevel``, ``use_regex=true``) is exactly GPT-2's. This wrapper answers
``gpt-2`` in that one case, only for a tokenizer whose ``tokenizer.json`` says so, and runs
the converter's own ``main`` with the remaining arguments (and lets a checkpoint with no
``tokenizer.model`` skip SentencePiece without importing it)::

    .venv/bin/python bench/engine_peers/convert_gguf.py \\
        --converter .peers/src/llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py \\
        --outtype f32 --outfile .peers/sluice-tiny-f32.gguf models/sluice-tiny

Used by ``scripts/install_peers.sh``; it needs torch, transformers and numpy (Sluice's venv
has them); the converter's own ``gguf-py`` comes from beside it.
"""

from __future__ import annotations

import argparse
import json
import logging
import runpy
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger("convert_gguf")


def is_gpt2_byte_level(model_dir: Path) -> bool:
    """Whether ``model_dir``'s ``tokenizer.json`` pre-tokenizes as GPT-2 (byte-level, its regex)."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return False
    pre = json.loads(path.read_text()).get("pre_tokenizer") or {}
    return pre.get("type") == "ByteLevel" and pre.get("use_regex", True) is True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--converter", type=Path, required=True, help="convert_hf_to_gguf.py")
    args, rest = parser.parse_known_args(argv)
    model_dirs = [Path(a) for a in rest if not a.startswith("-") and Path(a).is_dir()]
    gpt2 = bool(model_dirs) and is_gpt2_byte_level(model_dirs[-1])

    converter_dir = args.converter.resolve().parent
    # Its `conversion` package, and the gguf-py it ships (the converter puts it there too).
    sys.path[:0] = [str(converter_dir), str(converter_dir / "gguf-py")]
    from conversion import base  # type: ignore[import-not-found]

    known = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self: Any, tokenizer: Any) -> str:
        try:
            return str(known(self, tokenizer))
        except NotImplementedError:
            if not gpt2:
                raise
            logger.warning("unknown BPE pre-tokenizer hash; tokenizer.json says GPT-2's: gpt-2")
            return "gpt-2"

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre

    # A Llama checkpoint's vocabulary is tried as SentencePiece first, and a missing
    # tokenizer.model moves on to the BPE readers; but the converter imports sentencepiece
    # before it looks for the file, and Sluice's venv has no sentencepiece (nor need: a
    # tokenizer.json is read by the BPE path). Say "no file" before that import.
    create_sentencepiece = base.TextModel._create_vocab_sentencepiece

    def _create_vocab_sentencepiece(self: Any) -> Any:
        if not (self.dir_model / "tokenizer.model").is_file():
            raise FileNotFoundError(f"File not found: {self.dir_model / 'tokenizer.model'}")
        return create_sentencepiece(self)

    base.TextModel._create_vocab_sentencepiece = _create_vocab_sentencepiece
    sys.argv = [str(args.converter), *rest]
    runpy.run_path(str(args.converter), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
