"""A GGUF model as a Hugging Face checkpoint directory in fp32, for the engine peers.

The default model (SmolLM2-135M-Instruct) ships as a Q4_1 GGUF file. Sluice and
``transformers`` dequantize it at load and run fp32; so that vLLM and llama.cpp run the same
fp32 weights (not their own Q4_1 arithmetic), ``transformers`` reads
the file (its GGUF support dequantizes and undoes llama.cpp's Q/K row permutation) and saves
the model and its tokenizer here; ``convert_gguf.py`` then makes the f32 GGUF from that::

    .venv/bin/python bench/engine_peers/export_hf.py default .peers/smollm2-135m-hf

Used by ``scripts/install_peers.sh``, with Sluice's venv.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import transformers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", help="a .gguf file, or `default` for sluice serve's default")
    parser.add_argument("out", type=Path, help="the checkpoint directory to write")
    args = parser.parse_args(argv)
    if args.gguf == "default":
        from sluice.engine.default_model import default_model_file

        path = default_model_file()
    else:
        path = Path(args.gguf)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    # Loaded from GGUF, the weights are already plain fp32 tensors; only the marker that they
    # came from a quantized file stops save_pretrained.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    (args.out / "source.json").write_text(json.dumps({"gguf": str(path)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
