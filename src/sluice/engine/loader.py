"""Loading a Hugging Face-format checkpoint directory: ``config.json``, ``*.safetensors``,
``tokenizer.json``. ``model_type`` picks the architecture: ``gpt2`` or ``llama``.

Weights are read with ``safetensors`` and loaded strictly by name into our model. Llama
checkpoints load as they are (a missing ``lm_head.weight`` is tied to the embeddings when
``tie_word_embeddings`` is set). GPT-2 checkpoints get two normalisations that real GPT-2
files need: the original ``gpt2`` files name
parameters without the ``transformer.`` prefix, and they carry non-persistent causal-mask
buffers (``attn.bias``, ``attn.masked_bias``) that our paged model has no use for. A
missing ``lm_head.weight`` is tied to the token embedding, as in Hugging Face.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from sluice.engine.models.gpt2 import GPT2Config, GPT2LMHeadModel
from sluice.engine.models.llama import LlamaConfig, LlamaForCausalLM
from sluice.engine.tokenizer import Tokenizer

__all__ = ["Checkpoint", "CheckpointError", "load_checkpoint"]

_SKIPPED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message says what is wrong."""


@dataclass(frozen=True)
class Checkpoint:
    """A loaded model with its tokenizer; ``name`` is the directory's name."""

    name: str
    model: GPT2LMHeadModel | LlamaForCausalLM
    config: GPT2Config | LlamaConfig
    tokenizer: Tokenizer


def _read_config(directory: Path) -> dict[str, object]:
    path = directory / "config.json"
    try:
        config = json.loads(path.read_text("utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{directory}: no config.json") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    model_type = config.get("model_type", "gpt2")
    if model_type not in ("gpt2", "llama"):
        raise CheckpointError(f"{path}: model_type {model_type!r} is not supported yet")
    return config


def _state_dict(directory: Path, model_type: str, *, tied: bool) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            if model_type == "gpt2":
                if name.endswith(_SKIPPED_SUFFIXES):
                    continue
                if not name.startswith(("transformer.", "lm_head.")):
                    name = "transformer." + name
            state[name] = tensor.float()
    embeddings = "transformer.wte.weight" if model_type == "gpt2" else "model.embed_tokens.weight"
    if tied and "lm_head.weight" not in state and embeddings in state:
        state["lm_head.weight"] = state[embeddings]
    return state


def load_checkpoint(directory: str | Path) -> Checkpoint:
    """Load a GPT-2 or Llama checkpoint directory onto the CPU in fp32."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory")
    hf_config = _read_config(directory)
    model_type = str(hf_config.get("model_type", "gpt2"))
    config: GPT2Config | LlamaConfig
    model: GPT2LMHeadModel | LlamaForCausalLM
    try:
        if model_type == "llama":
            config = LlamaConfig.from_hf_config(hf_config)
            model = LlamaForCausalLM(config)
        else:
            config = GPT2Config.from_hf_config(hf_config)
            model = GPT2LMHeadModel(config)
    except ValueError as exc:
        raise CheckpointError(f"{directory}/config.json: {exc}") from exc
    try:
        tied = isinstance(config, GPT2Config) or config.tie_word_embeddings
        model.load_state_dict(_state_dict(directory, model_type, tied=tied), strict=True)
    except RuntimeError as exc:
        raise CheckpointError(f"{directory}: weights do not fit config.json: {exc}") from exc
    model.eval()
    tokenizer = Tokenizer.from_file(directory / "tokenizer.json")
    return Checkpoint(directory.name, model, config, tokenizer)
