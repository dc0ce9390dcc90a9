"""Llama as a paged-attention decoder: one engine step over many sequences' packed tokens.

Same step design as :mod:`sluice.engine.models.gpt2` (packed 1-D ``input_ids`` and
``positions``, one :class:`~sluice.engine.models.step.StepSequence` per sequence, logits of
each sequence's last new token), so the engine can run either model.

Parameter names match Hugging Face ``LlamaForCausalLM`` state dicts
(``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.q_proj.weight``, ...,
``model.norm.weight``, ``lm_head.weight``). Linear layers have no biases. ``lm_head.weight``
is tied to ``model.embed_tokens.weight`` when ``tie_word_embeddings`` is set.

The cache stores ``num_key_value_heads`` heads (grouped-query attention); K is rotated with
the rotary embedding before it is written, and cached K/V are expanded to the query heads
when attending.

Deliberate divergences from Hugging Face ``LlamaForCausalLM``:

1. No dropout, attention-mask/padding inputs or ``past_key_values``: the paged cache
   replaces them.
2. ``rope_scaling``, a ``rope_type`` other than ``default``, and attention or MLP biases
   are not supported (rejected by :meth:`LlamaConfig.from_hf_config`).
3. Only the logits of each sequence's last new token are computed.

:meth:`LlamaForCausalLM.decode` runs a step of decodes laid out by the caller, as
GPT-2's does.
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
    StepLayout,
    StepSequence,
    begin_step,
    last_token_indices,
    write_and_attend,
)

__all__ = ["LlamaConfig", "LlamaForCausalLM"]

_INT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
)


@dataclass(frozen=True)
class LlamaConfig:
    """The ``config.json`` fields that shape a Llama model (HF names).

    ``num_key_value_heads`` defaults to ``num_attention_heads`` when ``None``.
    """

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                f"{self.num_attention_heads}"
            )
        if self.num_attention_heads % self.kv_heads != 0:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not divisible by "
                f"num_key_value_heads {self.kv_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        """``num_key_value_heads`` as an ``int`` (resolved in ``__post_init__``)."""
        assert self.num_key_value_heads is not None
        return self.num_key_value_heads

    @property
    def n_positions(self) -> int:
        """``max_position_embeddings`` under the name the engine uses for every model."""
        return self.max_position_embeddings

    @classmethod
    def from_hf_config(cls, config: Mapping[str, object]) -> LlamaConfig:
        """Build from a parsed HF ``config.json``; other keys are ignored.

        Only the ``silu`` activation and no ``rope_scaling`` are supported.
        """
        activation = config.get("hidden_act", "silu")
        if activation != "silu":
            raise ValueError(f"unsupported hidden_act {activation!r}")
        if config.get("rope_scaling") is not None:
            raise ValueError(f"rope_scaling is not supported, got {config['rope_scaling']!r}")
        for name in ("attention_bias", "mlp_bias"):
            if config.get(name):
                raise ValueError(f"{name} is not supported")
        values: dict[str, int | float | bool] = {}
        # transformers 5 writes rope_theta inside rope_parameters; older files at the top.
        rope = config.get("rope_parameters")
        if rope is not None:
            if not isinstance(rope, Mapping):
                raise ValueError(f"rope_parameters must be an object, got {rope!r}")
            if rope.get("rope_type", "default") != "default":
                raise ValueError(f"rope_type {rope['rope_type']!r} is not supported")
            if "rope_theta" in rope:
                config = {**config, "rope_theta": rope["rope_theta"]}
        for name in _INT_FIELDS:
            value = config.get(name)
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an int, got {value!r}")
            values[name] = value
        for name in ("rms_norm_eps", "rope_theta"):
            if name in config:
                number = config[name]
                if not isinstance(number, int | float) or isinstance(number, bool):
                    raise ValueError(f"{name} must be a number, got {number!r}")
                values[name] = float(number)
        if "tie_word_embeddings" in config:
            tie = config["tie_word_embeddings"]
            if not isinstance(tie, bool):
                raise ValueError(f"tie_word_embeddings must be a bool, got {tie!r}")
            values["tie_word_embeddings"] = tie
        result = cls(**values)  # type: ignore[arg-type]
        head_dim = config.get("head_dim")
        if head_dim is not None and head_dim != result.head_dim:
            raise ValueError(
                f"head_dim {head_dim!r} differs from hidden_size // num_attention_heads "
                f"{result.head_dim}"
            )
        return result


class LlamaRMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * weight``, normalised in fp32."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden.dtype
        x = hidden.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        out: torch.Tensor = self.weight * x.to(input_dtype)
        return out


def rotary_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of shape ``[num_tokens, head_dim]`` (HF ``rotate_half`` layout)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float()
    inv_freq = 1.0 / (theta ** (exponents / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (``[num_tokens, heads, head_dim]``) by per-token ``cos``/``sin``."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


class LlamaAttention(nn.Module):
    """Grouped-query causal self-attention with rotary embeddings over the paged KV cache."""

    def __init__(self, config: LlamaConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.kv_heads
        self.head_dim = config.head_dim
        hidden, kv_dim = config.hidden_size, config.kv_heads * config.head_dim
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layout: StepLayout,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q = self.q_proj(hidden).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        attended = write_and_attend(q, k, v, layout, kv_cache, self.layer_index)
        out: torch.Tensor = self.o_proj(attended)
        return out


class LlamaMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(hidden)) * self.up_proj(hidden))
        return out


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_index)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layout: StepLayout,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, layout, kv_cache)
        out: torch.Tensor = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return out


class LlamaModel(nn.Module):
    """The ``model`` half of the HF model: embeddings, decoder layers, final RMSNorm."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Llama with its LM head, run one packed engine step at a time.

    Call under ``torch.inference_mode()``; the cache is passed to every ``forward``.
    Step errors raise :class:`~sluice.engine.models.step.StepError`, as for GPT-2.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
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
        weight = self.model.embed_tokens.weight
        return KVCache(
            num_layers=self.config.num_hidden_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=self.config.kv_heads,
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
            num_layers=config.num_hidden_layers,
            num_kv_heads=config.kv_heads,
            head_dim=config.head_dim,
            max_positions=config.n_positions,
        )
        hidden = self._hidden(input_ids, positions, layout, kv_cache)
        return self._head(self.model.norm(hidden[last_token_indices(seqs, hidden.device)]))

    def decode(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        layout: StepLayout,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        """Logits ``[num_tokens, vocab_size]`` of every packed token of a step of decodes
        (one new token a sequence) laid out by the caller, unchecked."""
        return self._head(self.model.norm(self._hidden(input_ids, positions, layout, kv_cache)))

    def _hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        layout: StepLayout,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        hidden: torch.Tensor = self.model.embed_tokens(input_ids)
        cos, sin = rotary_cos_sin(
            positions, self.config.head_dim, self.config.rope_theta, hidden.dtype
        )
        for layer in self.model.layers:
            hidden = layer(hidden, cos, sin, layout, kv_cache)
        return hidden
