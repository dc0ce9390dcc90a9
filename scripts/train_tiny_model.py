"""Train the bundled tiny GPT-2 (and its draft model) on the Python standard library's docs.

Everything is offline: the corpus is the docstrings of the running Python's standard library
(the prose ``pydoc`` shows), the tokenizer is a byte-level BPE trained on it with
``tokenizers``, and the model is :class:`sluice.engine.models.gpt2.GPT2LMHeadModel` trained
with a dense causal forward written here (the engine's own forward is the paged inference
path). The result is saved in Hugging Face format (``config.json``, ``model.safetensors``
in fp16, ``tokenizer.json``), so ``sluice serve --model DIR`` and ``transformers`` both
load it.

    .venv/bin/python scripts/train_tiny_model.py --out models/sluice-tiny \\
        --layers 4 --width 256 --heads 8 --minutes 50
    .venv/bin/python scripts/train_tiny_model.py --init models/sluice-tiny \\
        --out models/sluice-tiny --layers 4 --width 256 --heads 8 --minutes 35 --lr 2e-3 --seed 1
    .venv/bin/python scripts/train_tiny_model.py --out models/sluice-tiny-draft \\
        --tokenizer models/sluice-tiny/tokenizer.json --layers 2 --width 128 --heads 4 --minutes 10

``models/README.md`` records how the committed models were made.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import json
import math
import pkgutil
import random
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from sluice.engine.models.gpt2 import GPT2Config, GPT2LMHeadModel

EOS = "<|endoftext|>"


SKIP_PACKAGES = {"idlelib", "tkinter", "turtle", "turtledemo", "test", "lib2to3", "ensurepip"}


def stdlib_modules() -> list[str]:
    """The standard library's public modules and subpackages, sorted."""
    stdlib = set(sys.stdlib_module_names)
    names: set[str] = set()
    for info in pkgutil.iter_modules():
        if info.name not in stdlib or info.name.startswith("_") or info.name in SKIP_PACKAGES:
            continue
        names.add(info.name)
        if info.ispkg:
            with contextlib.suppress(Exception):
                package = importlib.import_module(info.name)
                for sub in pkgutil.walk_packages(package.__path__, info.name + "."):
                    if "test" not in sub.name and "._" not in sub.name:
                        names.add(sub.name)
    return sorted(names - {"antigravity", "this"})


def stdlib_docs(max_chars: int) -> list[str]:
    """The docstrings (the prose that ``pydoc`` shows) of the standard library.

    Module, class, function and method docstrings of at least 80 characters, each once, in a
    fixed order, so the corpus is the same on every machine with the same Python.
    """
    docs: list[str] = []
    seen: set[str] = set()
    total = 0

    def add(obj: object) -> None:
        nonlocal total
        doc = inspect.getdoc(obj)
        if doc and len(doc) >= 80 and doc not in seen:
            seen.add(doc)
            docs.append(doc)
            total += len(doc)

    for name in stdlib_modules():
        try:
            with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
                warnings.simplefilter("ignore")
                module = importlib.import_module(name)
        except Exception:  # a module that cannot be imported here is simply skipped
            continue
        add(module)
        for key, value in vars(module).items():
            if key.startswith("_"):
                continue
            if inspect.isclass(value) or inspect.isroutine(value):
                add(value)
            if inspect.isclass(value):
                for attr, member in vars(value).items():
                    if not attr.startswith("_") or attr == "__init__":
                        add(member)
        if total >= max_chars:
            break
    return docs


def train_tokenizer(pages: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(pages, trainer)
    return tokenizer


def dense_logits(model: GPT2LMHeadModel, ids: torch.Tensor) -> torch.Tensor:
    """Causal forward over ``ids`` ``[batch, time]`` with the model's own weights."""
    t = model.transformer
    batch, length = ids.shape
    hidden = t.wte(ids) + t.wpe(torch.arange(length))
    for block in t.h:
        attn = block.attn
        qkv = attn.c_attn(block.ln_1(hidden).reshape(batch * length, -1))
        q, k, v = qkv.view(batch, length, 3, attn.num_heads, attn.head_dim).unbind(dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        out = attn.c_proj(out.transpose(1, 2).reshape(batch * length, -1))
        hidden = hidden + out.view(batch, length, -1)
        mlp = block.mlp(block.ln_2(hidden).reshape(batch * length, -1))
        hidden = hidden + mlp.view(batch, length, -1)
    logits: torch.Tensor = model.lm_head(t.ln_f(hidden))
    return logits


@torch.no_grad()
def greedy(model: GPT2LMHeadModel, tokenizer: Tokenizer, prompt: str, tokens: int) -> str:
    ids = tokenizer.encode(prompt).ids
    for _ in range(tokens):
        ids.append(int(dense_logits(model, torch.tensor([ids]))[0, -1].argmax()))
    return str(tokenizer.decode(ids))


def save_checkpoint(model: GPT2LMHeadModel, tokenizer: Tokenizer, out: Path, eos_id: int) -> None:
    """Write ``model`` in Hugging Face format: ``config.json``, fp16 ``model.safetensors``
    (the LM head tied to the embeddings), ``tokenizer.json``."""
    config = model.config
    out.mkdir(parents=True, exist_ok=True)
    state = {
        k: v.detach().to(torch.float16).contiguous()
        for k, v in model.state_dict().items()
        if k != "lm_head.weight"  # tied to transformer.wte.weight, as in Hugging Face
    }
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf_config = {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "activation_function": "gelu_new",
        "vocab_size": config.vocab_size,
        "n_positions": config.n_positions,
        "n_ctx": config.n_positions,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "layer_norm_epsilon": config.layer_norm_epsilon,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "tie_word_embeddings": True,
        "torch_dtype": "float16",
    }
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    tokenizer.save(str(out / "tokenizer.json"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="output checkpoint directory")
    parser.add_argument("--tokenizer", type=Path, help="reuse this tokenizer.json")
    parser.add_argument(
        "--init", type=Path, help="continue training this checkpoint (same shape and tokenizer)"
    )
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=192)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--corpus-chars", type=int, default=6_000_000)
    parser.add_argument("--minutes", type=float, default=30.0, help="training time budget")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)

    pages = stdlib_docs(args.corpus_chars)
    print(f"corpus: {len(pages)} pages, {sum(map(len, pages)):,} characters", flush=True)
    if args.init and not args.tokenizer:
        args.tokenizer = args.init / "tokenizer.json"
    if args.tokenizer:
        tokenizer = Tokenizer.from_file(str(args.tokenizer))
    else:
        tokenizer = train_tokenizer(pages, args.vocab)
    eos_id = tokenizer.token_to_id(EOS)
    ids: list[int] = []
    for page in pages:
        ids += [*tokenizer.encode(page).ids, eos_id]
    data = torch.tensor(ids)
    print(f"tokens: {len(ids):,}", flush=True)

    config = GPT2Config(
        vocab_size=tokenizer.get_vocab_size(),
        n_positions=args.context,
        n_embd=args.width,
        n_layer=args.layers,
        n_head=args.heads,
    )
    model = GPT2LMHeadModel(config)
    if args.init:
        weights = load_file(str(args.init / "model.safetensors"))
        weights["lm_head.weight"] = weights["transformer.wte.weight"]
        model.load_state_dict({k: v.float() for k, v in weights.items()})
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    deadline = time.monotonic() + args.minutes * 60
    step = 0
    model.train()
    while time.monotonic() < deadline:
        starts = torch.randint(0, len(data) - args.context - 1, (args.batch,))
        batch = torch.stack([data[s : s + args.context + 1] for s in starts])
        logits = dense_logits(model, batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        progress = 1 - (deadline - time.monotonic()) / (args.minutes * 60)
        for group in optimizer.param_groups:  # warm-up, then cosine decay over the budget
            warm = min(1.0, (step + 1) / 100)
            group["lr"] = args.lr * warm * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        optimizer.step()
        step += 1
        if step % 50 == 0:
            print(f"step {step} loss {loss.item():.3f}", flush=True)

    model.eval()
    for prompt in ("Return the", "The socket"):
        print(f"sample: {prompt!r} -> {greedy(model, tokenizer, prompt, 40)!r}", flush=True)

    save_checkpoint(model, tokenizer, args.out, eos_id)
    print(f"saved {args.out} after {step} steps", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
