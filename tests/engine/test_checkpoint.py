"""Loading Hugging Face-format checkpoints: tokenizer bytes and safetensors weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from sluice.engine.detokenizer import IncrementalDetokenizer
from sluice.engine.kv_cache import num_blocks_for
from sluice.engine.loader import CheckpointError, load_checkpoint
from sluice.engine.models.gpt2 import GPT2Config, GPT2LMHeadModel, StepSequence
from sluice.engine.tokenizer import Tokenizer
from tests.tiny_tokenizer import train_tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Streams of tokens arrive one by one; nothing is lost, nothing is doubled.",
    "Unicode: café, naïve, 東京, emoji 🙂 and ☃.",
] * 20


@pytest.fixture
def checkpoint_dir(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    train_tokenizer(tmp_path / "tokenizer.json", CORPUS)
    vocab = Tokenizer.from_file(tmp_path / "tokenizer.json").vocab_size
    config = GPT2Config(vocab_size=vocab, n_positions=64, n_embd=32, n_layer=2, n_head=4)
    model = GPT2LMHeadModel(config)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    # The original gpt2 files: no "transformer." prefix, and the causal-mask buffers.
    state = {k.removeprefix("transformer."): v for k, v in state.items()}
    state["h.0.attn.bias"] = torch.ones(1, 1, 64, 64)
    save_file(state, str(tmp_path / "model.safetensors"))
    hf_config = {"model_type": "gpt2", "activation_function": "gelu_new", **vars(config)}
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    torch.save(model.state_dict(), tmp_path / "reference.pt")
    return tmp_path


@pytest.mark.parametrize("text", ["plain words", "café 東京 🙂☃", "  spaced\n\tout  ", ""])
def test_token_bytes_concatenate_to_the_text(checkpoint_dir: Path, text: str) -> None:
    tokenizer = Tokenizer.from_file(checkpoint_dir / "tokenizer.json")
    ids = tokenizer.encode(text)
    assert b"".join(tokenizer.token_bytes(t) for t in ids) == text.encode()
    detokenizer = IncrementalDetokenizer()
    out = "".join(detokenizer.push(tokenizer.token_bytes(t)) for t in ids) + detokenizer.flush()
    assert out == text
    assert tokenizer.eos_token_id is not None
    assert tokenizer.token_text(tokenizer.eos_token_id) == "<|endoftext|>"
    assert tokenizer.token_bytes(tokenizer.eos_token_id) == b""  # special: never output text


def test_a_checkpoint_loads_by_name_and_computes_the_same_logits(checkpoint_dir: Path) -> None:
    checkpoint = load_checkpoint(checkpoint_dir)
    reference = GPT2LMHeadModel(checkpoint.config)
    reference.load_state_dict(torch.load(checkpoint_dir / "reference.pt"))
    assert checkpoint.name == checkpoint_dir.name
    ids = torch.tensor(checkpoint.tokenizer.encode("The quick brown fox"))
    n = len(ids)
    step = [StepSequence(0, n, n, list(range(num_blocks_for(n, 8))))]
    with torch.inference_mode():
        ours = checkpoint.model(ids, torch.arange(n), step, checkpoint.model.make_kv_cache(8, 8))
        theirs = reference(ids, torch.arange(n), step, reference.make_kv_cache(8, 8))
    torch.testing.assert_close(ours, theirs)
    assert (
        checkpoint.model.lm_head.weight.data_ptr()
        == checkpoint.model.transformer.wte.weight.data_ptr()
    )


def test_broken_checkpoints_say_what_is_wrong(
    checkpoint_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    empty = tmp_path_factory.mktemp("empty")
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        load_checkpoint(empty)
    (empty / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(CheckpointError, match="not supported"):
        load_checkpoint(empty)
    (empty / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match="safetensors"):
        load_checkpoint(empty)
    config = json.loads((checkpoint_dir / "config.json").read_text())
    (checkpoint_dir / "config.json").write_text(json.dumps({**config, "n_embd": 64}))
    with pytest.raises(CheckpointError, match="do not fit"):
        load_checkpoint(checkpoint_dir)


@pytest.mark.parametrize("tied", [True, False])
def test_a_llama_checkpoint_loads_by_name(checkpoint_dir: Path, tied: bool) -> None:
    from sluice.engine.models.llama import LlamaConfig, LlamaForCausalLM

    vocab = Tokenizer.from_file(checkpoint_dir / "tokenizer.json").vocab_size
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(1)
    model = LlamaForCausalLM(config)
    state = model.state_dict()
    if tied:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    (checkpoint_dir / "model.safetensors").unlink()
    save_file(
        {k: v.contiguous() for k, v in state.items()}, str(checkpoint_dir / "model.safetensors")
    )
    hf_config = {
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "tie_word_embeddings": tied,
    }
    (checkpoint_dir / "config.json").write_text(json.dumps(hf_config))
    checkpoint = load_checkpoint(checkpoint_dir)
    assert isinstance(checkpoint.model, LlamaForCausalLM)
    ids = torch.tensor(checkpoint.tokenizer.encode("The quick brown fox"))
    n = len(ids)
    step = [StepSequence(0, n, n, list(range(num_blocks_for(n, 8))))]
    with torch.inference_mode():
        ours = checkpoint.model(ids, torch.arange(n), step, checkpoint.model.make_kv_cache(8, 8))
        theirs = model(ids, torch.arange(n), step, model.make_kv_cache(8, 8))
    torch.testing.assert_close(ours, theirs)
