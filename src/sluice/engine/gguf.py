"""A GGUF model file (llama.cpp, Ollama) as our model: config, fp32 weights, special tokens.

Two architectures (``general.architecture``) are read: ``llama`` into
:class:`~sluice.engine.models.llama.LlamaForCausalLM` and ``gpt2`` into
:class:`~sluice.engine.models.gpt2.GPT2LMHeadModel`. Every tensor is dequantized to float32 at
load (any type the ``gguf`` package can dequantize: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0, the K-quants Q2_K-Q6_K, ...), then renamed to the Hugging Face names our models use.
Undoing llama.cpp's converter (``convert_hf_to_gguf.py``) takes two more steps:

1. Llama's Q and K projections: the converter permutes each head's rows from Hugging Face's
   rotary layout (first half of the head, then second half) to GGML's interleaved pairs,
   ``w.reshape(heads, 2, head_dim // 2, in).swapaxes(1, 2)``, with ``head_count`` heads for
   Q and ``head_count_kv`` for K. :func:`unpermute_rows` applies the inverse.
2. GPT-2's linear layers: Hugging Face stores them as ``Conv1D`` (``[in, out]``), the
   converter transposes them to ``[out, in]``; they are transposed back.

A Llama file without ``output.weight`` ties the LM head to the token embedding, as
llama.cpp does; a GPT-2 file's ``output.weight`` (the converter's copy of the embedding) is
skipped, since GPT-2's head is always tied. The context length is ``{arch}.context_length``.

Refused with a clear :class:`~sluice.engine.gguf_file.GGUFError`: other architectures, and
Llama files with rope scaling (``rope_freqs.weight``, ``{arch}.rope.scaling.type``) or a
partial rotary dimension, which our Llama does not implement.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from sluice.engine.gguf_file import GGUFError, GGUFFile, MetadataValue
from sluice.engine.models.gpt2 import GPT2Config
from sluice.engine.models.llama import LlamaConfig

__all__ = ["GGUFModel", "read_gguf_model", "unpermute_rows"]

SUPPORTED_ARCHITECTURES = ("llama", "gpt2")

_LLAMA_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LLAMA_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GPT2_LAYER_NAMES = {
    "attn_norm.weight": "ln_1.weight",
    "attn_norm.bias": "ln_1.bias",
    "attn_qkv.weight": "attn.c_attn.weight",
    "attn_qkv.bias": "attn.c_attn.bias",
    "attn_output.weight": "attn.c_proj.weight",
    "attn_output.bias": "attn.c_proj.bias",
    "ffn_norm.weight": "ln_2.weight",
    "ffn_norm.bias": "ln_2.bias",
    "ffn_up.weight": "mlp.c_fc.weight",
    "ffn_up.bias": "mlp.c_fc.bias",
    "ffn_down.weight": "mlp.c_proj.weight",
    "ffn_down.bias": "mlp.c_proj.bias",
}
_GPT2_NAMES = {
    "token_embd.weight": "transformer.wte.weight",
    "position_embd.weight": "transformer.wpe.weight",
    "output_norm.weight": "transformer.ln_f.weight",
    "output_norm.bias": "transformer.ln_f.bias",
    "output.weight": "lm_head.weight",
}
# GPT-2's Conv1D weights, transposed by the converter.
_GPT2_TRANSPOSED = ("attn_qkv.weight", "attn_output.weight", "ffn_up.weight", "ffn_down.weight")
_LAYER = re.compile(r"blk\.(\d+)\.(.+)")


@dataclass(frozen=True)
class GGUFModel:
    """What a GGUF file says about its model, with its weights under Hugging Face names."""

    architecture: str
    config: GPT2Config | LlamaConfig
    state_dict: dict[str, torch.Tensor]
    metadata: dict[str, MetadataValue]


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (see the module) for ``num_heads`` heads."""
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise GGUFError(f"{rows} rows cannot be {num_heads} heads of rotary pairs")
    head_dim = rows // num_heads
    return (
        weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _number(metadata: dict[str, MetadataValue], key: str, default: float | None = None) -> float:
    value = metadata.get(key, default)
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise GGUFError(f"metadata {key} is {value!r}, not a number")
    return value


def _int(metadata: dict[str, MetadataValue], key: str, default: int | None = None) -> int:
    value = metadata.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise GGUFError(f"metadata {key} is {value!r}, not an integer")
    return value


def _vocab_size(file: GGUFFile, arch: str) -> int:
    tokens = file.metadata.get("tokenizer.ggml.tokens")
    fallback = len(tokens) if isinstance(tokens, list) else None
    if fallback is None and "token_embd.weight" in file.tensors:
        fallback = file.tensors["token_embd.weight"].shape[0]
    return _int(file.metadata, f"{arch}.vocab_size", fallback)


def _llama_config(file: GGUFFile) -> LlamaConfig:
    meta = file.metadata
    if "rope_freqs.weight" in file.tensors:
        raise GGUFError("rope scaling (rope_freqs.weight) is not supported")
    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling not in ("none", "linear") or (
        scaling == "linear" and _number(meta, "llama.rope.scaling.factor", 1.0) != 1.0
    ):
        raise GGUFError(f"rope scaling {scaling!r} is not supported")
    num_heads = _int(meta, "llama.attention.head_count")
    hidden_size = _int(meta, "llama.embedding_length")
    if num_heads <= 0 or hidden_size % num_heads:
        raise GGUFError(f"embedding_length {hidden_size} is not {num_heads} heads")
    head_dim = hidden_size // num_heads
    for key in ("llama.rope.dimension_count", "llama.attention.key_length"):
        if _int(meta, key, head_dim) != head_dim:
            raise GGUFError(f"{key} {meta[key]!r} differs from the head size {head_dim}")
    return LlamaConfig(
        vocab_size=_vocab_size(file, "llama"),
        hidden_size=hidden_size,
        intermediate_size=_int(meta, "llama.feed_forward_length"),
        num_hidden_layers=_int(meta, "llama.block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=_int(meta, "llama.attention.head_count_kv", num_heads),
        max_position_embeddings=_int(meta, "llama.context_length"),
        rms_norm_eps=_number(meta, "llama.attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=_number(meta, "llama.rope.freq_base", 10000.0),
        tie_word_embeddings="output.weight" not in file.tensors,
    )


def _gpt2_config(file: GGUFFile) -> GPT2Config:
    meta = file.metadata
    return GPT2Config(
        vocab_size=_vocab_size(file, "gpt2"),
        n_positions=_int(meta, "gpt2.context_length"),
        n_embd=_int(meta, "gpt2.embedding_length"),
        n_layer=_int(meta, "gpt2.block_count"),
        n_head=_int(meta, "gpt2.attention.head_count"),
        layer_norm_epsilon=_number(meta, "gpt2.attention.layer_norm_epsilon", 1e-5),
    )


def _hf_name(name: str, arch: str, num_layers: int) -> tuple[str, str]:
    """The Hugging Face name of GGUF tensor ``name`` and its per-layer suffix ('' if none)."""
    llama = arch == "llama"
    top = _LLAMA_NAMES if llama else _GPT2_NAMES
    per_layer = _LLAMA_LAYER_NAMES if llama else _GPT2_LAYER_NAMES
    if name in top:
        return top[name], ""
    match = _LAYER.fullmatch(name)
    if match is not None and match.group(2) in per_layer and int(match.group(1)) < num_layers:
        prefix = "model.layers" if arch == "llama" else "transformer.h"
        return f"{prefix}.{match.group(1)}.{per_layer[match.group(2)]}", match.group(2)
    raise GGUFError(f"tensor {name!r} has no place in a {arch} model")


def read_gguf_model(file: GGUFFile) -> GGUFModel:
    """Read the config and every weight of ``file`` (dequantized to float32)."""
    arch = file.metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            f"architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    try:
        config: GPT2Config | LlamaConfig
        config = _llama_config(file) if arch == "llama" else _gpt2_config(file)
    except ValueError as exc:  # GGUFError, or the config's own checks
        raise GGUFError(f"{file.path}: {exc}") from exc
    num_layers = config.num_hidden_layers if isinstance(config, LlamaConfig) else config.n_layer
    fix: dict[str, Callable[[np.ndarray], np.ndarray]] = {}
    if isinstance(config, LlamaConfig):
        num_heads, num_kv_heads = config.num_attention_heads, config.kv_heads
        fix["attn_q.weight"] = lambda w: unpermute_rows(w, num_heads)
        fix["attn_k.weight"] = lambda w: unpermute_rows(w, num_kv_heads)
    state: dict[str, torch.Tensor] = {}
    for tensor in file:
        if arch == "gpt2" and tensor.name == "output.weight":
            continue  # the converter's copy of token_embd: our GPT-2's head is always tied
        try:
            hf_name, suffix = _hf_name(tensor.name, str(arch), num_layers)
            weight = file.dequantize(tensor.name)
            if arch == "gpt2" and suffix in _GPT2_TRANSPOSED:
                weight = weight.T
            if suffix in fix:
                weight = fix[suffix](weight)
        except GGUFError as exc:
            raise GGUFError(f"{file.path}: {exc}") from exc
        state[hf_name] = torch.from_numpy(np.ascontiguousarray(weight))
    embeddings = "model.embed_tokens.weight" if arch == "llama" else "transformer.wte.weight"
    if "lm_head.weight" not in state and embeddings in state:
        state["lm_head.weight"] = state[embeddings]
    return GGUFModel(str(arch), config, state, file.metadata)
