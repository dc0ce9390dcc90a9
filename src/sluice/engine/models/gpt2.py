"""GPT-2 as a paged-attention decoder: one engine step over many sequences' packed tokens.

Parameter names match Hugging Face GPT-2 state dicts (``transformer.wte.weight``,
``transformer.h.{i}.attn.c_attn.weight``, ..., ``lm_head.weight``), so a checkpoint loads
with ``load_state_dict``. HF stores its linear layers as ``Conv1D``: the weight is
``[in_features, out_features]`` and ``y = x @ W + b``. ``lm_head.weight`` is tied to
``transformer.wte.weight``.

A step's tokens from every scheduled sequence are packed into one 1-D ``input_ids``;
:class:`StepSequence` says which slice belongs to which sequence. Per layer, Q, K and V are
projected for all packed tokens at once, the new K and V are written into the
:class:`~sluice.engine.kv_cache.KVCache` through each sequence's ``slot_mapping``, and then
each sequence's queries attend to its keys gathered from the cache through its
``block_table``. The same code therefore serves prefill, chunked prefill and decode.

Deliberate divergences from Hugging Face ``GPT2LMHeadModel``:

1. No dropout, no attention-mask/padding inputs, no ``past_key_values``: the paged cache
   replaces all three.
2. HF's non-persistent ``attn.bias`` / ``attn.masked_bias`` causal-mask buffers are absent;
   load older checkpoints that carry them with ``strict=False`` or drop those keys.
3. Only the logits of each sequence's last new token are computed.

:meth:`GPT2LMHeadModel.decode` runs a step of decodes whose layout the caller made
(:class:`~sluice.engine.models.decode.DecodeRounds`, a draft model's rounds): no checks, no
layout, the logits of every token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sluice.engine.kv_cache import KVCache
from sluice.engine.models.head import LMHead
from sluice.engine.models.step import (
    StepError,
    StepLayout,
    StepSequence,
    begin_step,
    last_token_indices,
    write_and_attend,
)

__all__ = ["GPT2Config", "GPT2LMHeadModel", "GPT2StepError", "StepSequence"]


GPT2StepError = StepError  # the name this module first had


@dataclass(frozen=True)
class GPT2Config:
    """The ``config.json`` fields that shape a GPT-2 model (HF names)."""

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    layer_norm_epsilon: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}")
        if not self.layer_norm_epsilon > 0:
            raise ValueError(f"layer_norm_epsilon must be positive, got {self.layer_norm_epsilon}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def from_hf_config(cls, config: Mapping[str, object]) -> GPT2Config:
        """Build from a parsed HF ``config.json``; other keys are ignored.

        Only the ``gelu_new`` activation is supported.
        """
        activation = config.get("activation_function", "gelu_new")
        if activation != "gelu_new":
            raise ValueError(f"unsupported activation_function {activation!r}")
        values: dict[str, int | float] = {}
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            if name in config:
                value = config[name]
                if not isinstance(value, int) or isinstance(value, bool):
                    raise ValueError(f"{name} must be an int, got {value!r}")
                values[name] = value
        if "layer_norm_epsilon" in config:
            epsilon = config["layer_norm_epsilon"]
            if not isinstance(epsilon, int | float) or isinstance(epsilon, bool):
                raise ValueError(f"layer_norm_epsilon must be a number, got {epsilon!r}")
            values["layer_norm_epsilon"] = float(epsilon)
        return cls(**values)  # type: ignore[arg-type]


class Conv1D(nn.Module):
    """HF's transposed linear layer: ``weight`` is ``[in_features, out_features]``."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.zeros(out_features))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x, self.weight)


class GPT2Attention(nn.Module):
    """Multi-head causal self-attention over the paged KV cache."""

    def __init__(self, config: GPT2Config, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.n_head
        self.head_dim = config.head_dim
        self.c_attn = Conv1D(config.n_embd, 3 * config.n_embd)
        self.c_proj = Conv1D(config.n_embd, config.n_embd)

    def forward(
        self,
        hidden: torch.Tensor,
        layout: StepLayout,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv: torch.Tensor = self.c_attn(hidden)
        q, k, v = qkv.view(num_tokens, 3, self.num_heads, self.head_dim).unbind(dim=1)
        attended = write_and_attend(q, k, v, layout, kv_cache, self.layer_index)
        out: torch.Tensor = self.c_proj(attended)
        return out


class GPT2MLP(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.c_fc = Conv1D(config.n_embd, 4 * config.n_embd)
        self.c_proj = Conv1D(4 * config.n_embd, config.n_embd)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # gelu_new is GELU with the tanh approximation.
        out: torch.Tensor = self.c_proj(F.gelu(self.c_fc(hidden), approximate="tanh"))
        return out


class GPT2Block(nn.Module):
    def __init__(self, config: GPT2Config, layer_index: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = GPT2Attention(config, layer_index)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = GPT2MLP(config)

    def forward(
        self,
        hidden: torch.Tensor,
        layout: StepLayout,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        # GPT2Attention's and GPT2MLP's arithmetic over their parameters, inlined: a call
        # through nn.Module.__call__ per part was a tenth of a small model's decode step.
        ln_1, attn, ln_2, mlp = self.ln_1, self.attn, self.ln_2, self.mlp
        c_attn, attn_proj, c_fc, mlp_proj = attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj
        num_tokens = hidden.shape[0]
        x = F.layer_norm(hidden, ln_1.normalized_shape, ln_1.weight, ln_1.bias, ln_1.eps)
        qkv = torch.addmm(c_attn.bias, x, c_attn.weight)
        q, k, v = qkv.view(num_tokens, 3, attn.num_heads, attn.head_dim).unbind(dim=1)
        attended = write_and_attend(q, k, v, layout, kv_cache, attn.layer_index)
        hidden = hidden + torch.addmm(attn_proj.bias, attended, attn_proj.weight)
        x = F.layer_norm(hidden, ln_2.normalized_shape, ln_2.weight, ln_2.bias, ln_2.eps)
        # gelu_new is GELU with the tanh approximation.
        x = F.gelu(torch.addmm(c_fc.bias, x, c_fc.weight), approximate="tanh")
        return hidden + torch.addmm(mlp_proj.bias, x, mlp_proj.weight)


class GPT2Model(nn.Module):
    """The ``transformer`` half of the HF model: embeddings, blocks, final LayerNorm."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList(GPT2Block(config, i) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.01)


class GPT2LMHeadModel(nn.Module):
    """GPT-2 with its tied LM head, run one packed engine step at a time.

    Call under ``torch.inference_mode()``; the cache is passed to every ``forward``.
    """

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.config = config
        self.transformer = GPT2Model(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight
        self._head = LMHead(self.lm_head)

    def make_kv_cache(
        self,
        num_blocks: int,
        block_size: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> KVCache:
        """An empty cache shaped for this model (dtype and device default to its weights)."""
        weight = self.transformer.wte.weight
        return KVCache(
            num_layers=self.config.n_layer,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=self.config.n_head,
            head_dim=self.config.head_dim,
            dtype=weight.dtype if dtype is None else dtype,
            device=weight.device if device is None else device,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        seqs: Sequence[StepSequence],
        kv_cache: KVCache,
    ) -> torch.Tensor:
        """Logits ``[sum of num_logits, vocab_size]``: of the last new token of each sequence
        (its last ``num_logits``, for a speculative verify), in order.

        ``input_ids`` and ``positions`` are 1-D and packed: the ``seqs`` take consecutive
        slices in order and cover every token. ``positions[seq.start : seq.end]`` must be
        ``context_len - num_new_tokens .. context_len - 1`` for each sequence.
        """
        config = self.config
        layout = begin_step(
            input_ids,
            positions,
            seqs,
            kv_cache,
            num_layers=config.n_layer,
            num_kv_heads=config.n_head,
            head_dim=config.head_dim,
            max_positions=config.n_positions,
        )
        hidden = self._hidden(input_ids, positions, layout, kv_cache)
        return self._logits(hidden[last_token_indices(seqs, hidden.device)])

    def decode(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        layout: StepLayout,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        """Logits ``[num_tokens, vocab_size]`` of every packed token of a step of decodes
        (one new token a sequence) laid out by the caller, unchecked."""
        return self._logits(self._hidden(input_ids, positions, layout, kv_cache))

    def _hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        layout: StepLayout,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        transformer = self.transformer
        hidden = F.embedding(input_ids, transformer.wte.weight) + F.embedding(
            positions, transformer.wpe.weight
        )
        for block in transformer.h:
            hidden = block(hidden, layout, kv_cache)
        return hidden

    def transposed_head(self) -> torch.Tensor:
        """The LM head's weight as a contiguous ``[n_embd, vocab_size]`` copy, up to date."""
        return self._head.transposed_weight()

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        ln_f = self.transformer.ln_f
        return self._head(
            F.layer_norm(hidden, ln_f.normalized_shape, ln_f.weight, ln_f.bias, ln_f.eps)
        )
