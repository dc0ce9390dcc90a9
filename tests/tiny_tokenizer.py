"""A byte-level BPE ``tokenizer.json`` trained in a second, for tests that need real ones."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

__all__ = ["train_tokenizer"]


def train_tokenizer(path: Path, corpus: Sequence[str], vocab_size: int = 300) -> None:
    """Train a GPT-2-style tokenizer (with ``<|endoftext|>``) on ``corpus``; save to ``path``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.save(str(path))
