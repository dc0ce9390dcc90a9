"""Model definitions for the engine, each a ``torch.nn.Module`` run over the paged KV cache."""

from __future__ import annotations

from sluice.engine.models.gpt2 import GPT2Config, GPT2LMHeadModel, GPT2StepError
from sluice.engine.models.llama import LlamaConfig, LlamaForCausalLM
from sluice.engine.models.step import StepError, StepSequence

__all__ = [
    "GPT2Config",
    "GPT2LMHeadModel",
    "GPT2StepError",
    "LlamaConfig",
    "LlamaForCausalLM",
    "StepError",
    "StepSequence",
]
