"""Small random models whose greedy output varies (GPT-2's own init repeats one token)."""

from __future__ import annotations

import torch

from sluice.engine.models import GPT2Config, GPT2LMHeadModel

__all__ = ["ascii_bytes", "nan_at_position", "varied_gpt2"]


def ascii_bytes(token: int) -> bytes:
    """A printable byte per token id: a stand-in ``token_bytes`` for tests."""
    return bytes([33 + token % 90])


def varied_gpt2(config: GPT2Config, seed: int = 0) -> GPT2LMHeadModel:
    """A GPT-2 with weights far larger than its init, so greedy decoding varies."""
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "ln_" in name and name.endswith(".weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(0.3 * torch.randn_like(param))
    return model


def nan_at_position(config: GPT2Config, position: int, seed: int = 0) -> GPT2LMHeadModel:
    """:func:`varied_gpt2` with a NaN position embedding at ``position``: a sequence that
    reaches it gets NaN logits (as from a broken checkpoint), shorter ones are untouched."""
    model = varied_gpt2(config, seed)
    with torch.no_grad():
        model.transformer.wpe.weight[position] = float("nan")
    return model
