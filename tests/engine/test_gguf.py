"""GGUF files written here with the ``gguf`` package's own writer, loaded by ours.

The bundled ``sluice-tiny`` (GPT-2) is written as llama.cpp's converter writes GPT-2: its
names, its Conv1D weights transposed, its tokenizer as ``tokenizer.ggml.*`` metadata. Every
matrix is stored in one GGML type per file. Round-trip types (F32 ... Q4_1) are quantized
with ``gguf.quants`` and must load as exactly what dequantizing them gives; the K-quants,
which ``gguf`` cannot quantize, are random blocks checked against ``transformers``' own
dequantizer (an implementation no one here wrote). At F32 the file's logits equal the
safetensors checkpoint's.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers.integrations.gguf import dequant as hf_dequant

from sluice.engine.gguf import unpermute_rows
from sluice.engine.gguf_file import GGUFError, GGUFFile
from sluice.engine.loader import CheckpointError, load_checkpoint
from sluice.engine.models import GPT2Config, StepSequence

TINY = Path(__file__).resolve().parents[2] / "models" / "sluice-tiny"
TEXTS = ["Return a new socket object.", "café 東京 🙂 <|endoftext|> 12345", "  spaced\n\tout  "]
ROUND_TRIP = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1]
K_QUANTS = [Q.Q4_K, Q.Q6_K]
# Where each K-quant block keeps its fp16 scales (d, and dmin for Q4_K), as ggml lays it out.
_SCALE_OFFSETS = {Q.Q4_K: (0, 2), Q.Q6_K: (208,)}
_LAYER_NAMES = {
    "ln_1": "attn_norm",
    "attn.c_attn": "attn_qkv",
    "attn.c_proj": "attn_output",
    "ln_2": "ffn_norm",
    "mlp.c_fc": "ffn_up",
    "mlp.c_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    top = {
        "transformer.wte.weight": "token_embd.weight",
        "transformer.wpe.weight": "position_embd.weight",
        "transformer.ln_f.weight": "output_norm.weight",
        "transformer.ln_f.bias": "output_norm.bias",
    }
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER_NAMES[module]}.{kind}"


def _random_blocks(rows: int, cols: int, kind: Q, seed: int) -> np.ndarray:
    block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
    blocks = np.random.default_rng(seed).integers(0, 256, (rows * cols // block_size, type_size))
    blocks = blocks.astype(np.uint8)
    for offset in _SCALE_OFFSETS[kind]:  # finite, small scales
        scales = np.random.default_rng(seed + offset).uniform(1e-3, 1e-2, len(blocks))
        blocks[:, offset : offset + 2] = scales.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def write_tiny_gguf(path: Path, kind: Q) -> dict[str, np.ndarray]:
    """sluice-tiny as a GGUF with every matrix in ``kind``; returns the weights (HF names,
    our layout) that loading it must give."""
    checkpoint = load_checkpoint(TINY)
    config, tokenizer = checkpoint.config, checkpoint.tokenizer
    assert isinstance(config, GPT2Config)
    writer = gguf.GGUFWriter(str(path), arch="gpt2")
    writer.add_context_length(config.n_positions)
    writer.add_embedding_length(config.n_embd)
    writer.add_feed_forward_length(4 * config.n_embd)
    writer.add_block_count(config.n_layer)
    writer.add_head_count(config.n_head)
    writer.add_layer_norm_eps(config.layer_norm_epsilon)
    spec = json.loads(tokenizer.backend.to_str())
    tokens = [tokenizer.token_text(i) for i in range(tokenizer.vocab_size)]
    special = {t["id"] for t in spec["added_tokens"] if t["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    merges = spec["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_eos_token_id(tokenizer.eos_token_ids[0])
    writer.add_add_bos_token(False)
    expected: dict[str, np.ndarray] = {}
    for seed, (name, tensor) in enumerate(checkpoint.model.state_dict().items()):
        if name == "lm_head.weight":
            continue
        value = tensor.numpy()
        transposed = value.ndim == 2 and name.endswith(".weight") and ".h." in name
        stored = np.ascontiguousarray(value.T) if transposed else value  # [out, in], as llama.cpp
        if value.ndim == 1:
            writer.add_tensor(_gguf_name(name), stored)
            expected[name] = stored
            continue
        if kind in K_QUANTS:
            raw = _random_blocks(*stored.shape, kind, seed)
            writer.add_tensor(_gguf_name(name), raw, raw_dtype=kind)
            flat = hf_dequant.dequantize(torch.from_numpy(raw.reshape(-1)), int(kind))
            loaded = flat.reshape(stored.shape).numpy()
        elif kind == Q.F32:
            writer.add_tensor(_gguf_name(name), stored)
            loaded = stored
        else:
            raw = gguf.quants.quantize(stored, kind)
            writer.add_tensor(_gguf_name(name), raw, raw_dtype=kind)
            loaded = gguf.quants.dequantize(raw, kind)
        expected[name] = loaded.T if transposed else loaded
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.mark.parametrize("kind", ROUND_TRIP + K_QUANTS, ids=lambda kind: kind.name)
def test_every_type_loads_as_its_dequantized_values(tmp_path: Path, kind: Q) -> None:
    path = tmp_path / f"tiny.{kind.name}.gguf"
    expected = write_tiny_gguf(path, kind)
    checkpoint = load_checkpoint(path)
    assert checkpoint.name == f"tiny.{kind.name}"
    state = checkpoint.model.state_dict()
    for name, values in expected.items():
        np.testing.assert_array_equal(state[name].numpy(), values, err_msg=name)
    assert state["lm_head.weight"].data_ptr() == state["transformer.wte.weight"].data_ptr()


def test_an_f32_file_computes_the_checkpoints_logits_and_tokens(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf", Q.F32)
    ours, reference = load_checkpoint(tmp_path), load_checkpoint(TINY)  # a directory of one
    assert ours.name == tmp_path.name
    for text in TEXTS:
        assert ours.tokenizer.encode(text) == reference.tokenizer.encode(text)
    assert ours.tokenizer.eos_token_ids == reference.tokenizer.eos_token_ids
    assert ours.tokenizer.token_bytes(ours.tokenizer.eos_token_ids[0]) == b""
    ids = reference.tokenizer.encode(TEXTS[0] * 3)
    step = [StepSequence(0, len(ids), len(ids), [1, 0, 3, 2])]
    logits = []
    for checkpoint in (ours, reference):
        cache = checkpoint.model.make_kv_cache(4, 16)
        with torch.inference_mode():
            logits.append(checkpoint.model(torch.tensor(ids), torch.arange(len(ids)), step, cache))
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=0)


def test_a_tokenizer_json_beside_the_file_replaces_the_metadata_one(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf", Q.F16)
    from_metadata = load_checkpoint(tmp_path / "tiny.gguf").tokenizer
    last = from_metadata.vocab_size - 1
    assert from_metadata.token_bytes(last) != b""
    spec = json.loads((TINY / "tokenizer.json").read_text())
    spec["added_tokens"].append(  # the same token, made special beside the file
        {"id": last, "content": from_metadata.token_text(last), "single_word": False,
         "lstrip": False, "rstrip": False, "normalized": False, "special": True}
    )  # fmt: skip
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    beside = load_checkpoint(tmp_path / "tiny.gguf").tokenizer
    assert beside.token_bytes(last) == b""


def test_unpermute_rows_inverts_llama_cpps_permutation() -> None:
    heads, head_dim, width = 3, 8, 5
    weight = np.arange(heads * head_dim * width, dtype=np.float32).reshape(-1, width)
    # convert_hf_to_gguf.py's LlamaModel.permute
    permuted = weight.reshape(heads, 2, head_dim // 2, width).swapaxes(1, 2).reshape(weight.shape)
    np.testing.assert_array_equal(unpermute_rows(permuted, heads), weight)
    assert not np.array_equal(permuted, weight)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "cannot map"),
        (b"GGML" + bytes(20), "not a GGUF file"),
        (b"GGUF" + (1).to_bytes(4, "little") + bytes(16), "version 1 is not supported"),
        (b"GGUF" + (3).to_bytes(4, "little") + (1).to_bytes(8, "little"), "truncated"),
        (
            b"GGUF"
            + (3).to_bytes(4, "little")
            + (0).to_bytes(8, "little")
            + (2**40).to_bytes(8, "little"),
            "metadata entries",
        ),
    ],
    ids=["empty", "magic", "version", "truncated", "huge-count"],
)
def test_a_broken_file_is_refused_with_a_reason(
    tmp_path: Path, content: bytes, message: str
) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(content)
    with pytest.raises(GGUFError, match=message):
        GGUFFile(path)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path)


def test_an_unsupported_architecture_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), arch="mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match="architecture 'mamba' is not supported"):
        load_checkpoint(path)


def test_a_directory_of_several_gguf_files_asks_for_one(tmp_path: Path) -> None:
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"several \.gguf files \(a\.gguf, b\.gguf\)"):
        load_checkpoint(tmp_path)
