"""Loading a model: a Hugging Face-format checkpoint directory, or a GGUF file.

:func:`load_checkpoint` takes a directory with ``config.json``, ``*.safetensors`` and
``tokenizer.json`` (``model_type`` picks the architecture: ``gpt2`` or ``llama``), a
``.gguf`` file (llama.cpp's, Ollama's; :mod:`sluice.engine.gguf`), or a directory holding
exactly one ``.gguf`` and no ``config.json``. Beside the model it returns what serving it
needs: the chat template, BOS/EOS (:mod:`sluice.engine.hf_files` for a checkpoint
directory, the file's metadata for a GGUF; a ``tokenizer.json`` beside a GGUF replaces the
tokenizer its metadata describes) and the files whose bytes are the weights.

Weights are read with ``safetensors`` and loaded strictly by name into our model. Llama
checkpoints load as they are (a missing ``lm_head.weight`` is tied to the embeddings when
``tie_word_embeddings`` is set). GPT-2 checkpoints get two normalisations that real GPT-2
files need: the original ``gpt2`` files name
parameters without the ``transformer.`` prefix, and they carry non-persistent causal-mask
buffers (``attn.bias``, ``attn.masked_bias``) that our paged model has no use for. A
missing ``lm_head.weight`` is tied to the token embedding, as in Hugging Face.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from sluice.engine.engine import Engine
from sluice.engine.gguf import read_gguf_model
from sluice.engine.gguf_file import GGUFError, GGUFFile
from sluice.engine.gguf_vocab import gguf_special_tokens, gguf_tokenizer
from sluice.engine.hf_files import HFFilesError, read_chat_template, read_special_tokens
from sluice.engine.model_runner import PagedModel
from sluice.engine.models.gpt2 import GPT2Config, GPT2LMHeadModel
from sluice.engine.models.llama import LlamaConfig, LlamaForCausalLM
from sluice.engine.outputs import EngineConfig
from sluice.engine.placement import Placement
from sluice.engine.speculative import SpeculativeConfig
from sluice.engine.tokenizer import Tokenizer, TokenizerError

__all__ = ["Checkpoint", "CheckpointError", "load_checkpoint"]

_SKIPPED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message says what is wrong."""


@dataclass(frozen=True)
class Checkpoint:
    """A loaded model with its tokenizer; ``name`` is the directory's name (a GGUF file's
    name without ``.gguf``) unless the caller named it. ``chat_template`` is None for a
    model without one; ``bos_token``/``eos_token`` are the texts a template may write."""

    name: str
    model: GPT2LMHeadModel | LlamaForCausalLM
    config: GPT2Config | LlamaConfig
    tokenizer: Tokenizer
    chat_template: str | None = None
    bos_token: str = ""
    eos_token: str = ""
    weight_files: tuple[Path, ...] = ()
    placement: Placement = field(default_factory=Placement.cpu)

    def engine(
        self,
        *,
        num_blocks: int,
        max_num_seqs: int,
        speculation: SpeculativeConfig | None = None,
        draft_model: PagedModel | None = None,
    ) -> Engine:
        """An engine of this model with the limits ``sluice serve`` and ``sluice worker``
        run it with (:meth:`EngineConfig.for_serving`); :class:`ValueError` for limits
        that cannot hold."""
        config = EngineConfig.for_serving(
            self.config.n_positions, num_blocks=num_blocks, max_num_seqs=max_num_seqs
        )
        return Engine(
            self.model,
            config,
            eos_token_id=self.tokenizer.eos_token_ids,
            token_bytes=self.tokenizer.token_bytes,
            speculation=speculation,
            draft_model=draft_model,
        )


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


def _build(
    config: GPT2Config | LlamaConfig, state: dict[str, torch.Tensor], where: Path
) -> GPT2LMHeadModel | LlamaForCausalLM:
    """Our model of ``config`` with the weights of ``state`` (fp32 on the CPU), made on the
    meta device so that no random initialisation is paid for weights about to be replaced."""
    with torch.device("meta"):
        model = (
            LlamaForCausalLM(config) if isinstance(config, LlamaConfig) else GPT2LMHeadModel(config)
        )
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:
        raise CheckpointError(f"{where}: weights do not fit the config: {exc}") from exc
    if isinstance(model, GPT2LMHeadModel) or model.config.tie_word_embeddings:
        embeddings = (
            model.transformer.wte
            if isinstance(model, GPT2LMHeadModel)
            else model.model.embed_tokens
        )
        model.lm_head.weight = embeddings.weight  # assign=True replaced the shared parameter
    return model.eval()


def _load_directory(directory: Path, name: str) -> Checkpoint:
    hf_config = _read_config(directory)
    model_type = str(hf_config.get("model_type", "gpt2"))
    config: GPT2Config | LlamaConfig
    try:
        if model_type == "llama":
            config = LlamaConfig.from_hf_config(hf_config)
        else:
            config = GPT2Config.from_hf_config(hf_config)
    except ValueError as exc:
        raise CheckpointError(f"{directory}/config.json: {exc}") from exc
    tied = isinstance(config, GPT2Config) or config.tie_word_embeddings
    model = _build(config, _state_dict(directory, model_type, tied=tied), directory)
    try:
        backend = Tokenizer.from_file(directory / "tokenizer.json").backend
        special = read_special_tokens(directory, backend)
        tokenizer = Tokenizer(
            backend,
            eos_token_ids=special.eos_token_ids,
            bos_token_id=special.bos_token_id,
            add_bos_token=special.add_bos_token,
        )
        template = read_chat_template(directory)
    except (HFFilesError, TokenizerError) as exc:
        raise CheckpointError(str(exc)) from exc
    return Checkpoint(
        name,
        model,
        config,
        tokenizer,
        chat_template=template,
        bos_token=special.bos_token,
        eos_token=special.eos_token,
        weight_files=tuple(sorted(directory.glob("*.safetensors"))),
    )


def _load_gguf(path: Path, name: str) -> Checkpoint:
    try:
        with GGUFFile(path) as file:
            read = read_gguf_model(file)
            beside = path.parent / "tokenizer.json"
            backend = (
                Tokenizer.from_file(beside).backend
                if beside.is_file()
                else gguf_tokenizer(file.metadata)
            )
            vocab_size = backend.get_vocab_size(with_added_tokens=True)
            special = gguf_special_tokens(file.metadata, vocab_size)
            tokenizer = Tokenizer(
                backend,
                eos_token_ids=special.eos_token_ids or None,
                bos_token_id=special.bos_token_id,
                add_bos_token=special.add_bos_token,
            )
    except (GGUFError, TokenizerError) as exc:
        raise CheckpointError(str(exc) if str(path) in str(exc) else f"{path}: {exc}") from exc
    model = _build(read.config, read.state_dict, path)
    template = read.metadata.get("tokenizer.chat_template")
    bos, eos = special.bos_token_id, tokenizer.eos_token_id
    return Checkpoint(
        name,
        model,
        read.config,
        tokenizer,
        chat_template=template if isinstance(template, str) else None,
        bos_token="" if bos is None else tokenizer.token_text(bos),
        eos_token="" if eos is None else tokenizer.token_text(eos),
        weight_files=(path,),
    )


def load_checkpoint(
    path: str | Path, *, name: str | None = None, placement: Placement | None = None
) -> Checkpoint:
    """Load a checkpoint directory or a GGUF file (see the module): read in fp32 on the
    CPU, then moved to ``placement``'s device and dtype (default: stay there)."""
    checkpoint = _load(Path(path), name)
    if placement is None or placement == checkpoint.placement:
        return checkpoint
    checkpoint.model.to(device=placement.device, dtype=placement.dtype)
    return dataclasses.replace(checkpoint, placement=placement)


def _load(path: Path, name: str | None) -> Checkpoint:
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise CheckpointError(f"{path}: not a .gguf file nor a checkpoint directory")
        return _load_gguf(path, name or path.stem)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such file or directory")
    ggufs = sorted(path.glob("*.gguf"))
    if not (path / "config.json").exists() and ggufs:
        if len(ggufs) > 1:
            listed = ", ".join(file.name for file in ggufs)
            raise CheckpointError(f"{path}: holds several .gguf files ({listed}); name one")
        return _load_gguf(ggufs[0], name or path.name)
    return _load_directory(path, name or path.name)
