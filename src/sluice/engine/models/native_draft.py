"""Drafting by a GPT-2 draft model in C (``gpt2_draft.c``): every round of a step in one
call, for a float32 draft on the CPU (its matrices and LM head read in float16 where the
CPU converts it, F16C: a draft's tokens are proposals the target verifies, so this changes
how many are accepted, never the output).

A sequence drafts greedily, or samples: the kernel draws each draft from its ``q`` (the
softmax at the request's temperature after its top-k and top-p) by inverse CDF at a uniform
drawn here from the request's generator, and returns ``q`` for the acceptance rule. The
rule keeps the target's distribution whatever ``q`` is, as long as the draft drew from it.

:class:`~sluice.engine.proposer.DraftModelProposer` asks :meth:`NativeDraft.for_model`
once; when it gives a drafter, steps of up to 16 sequences whose catch-ups are short
draft through it, and the others through the torch model as before. The drafter
reads the model's parameters at every call (so a replaced or reloaded weight is never read
stale) and writes K/V to the draft's own paged cache exactly where the torch rounds would.
``SLUICE_NATIVE_KERNELS=0`` turns it off, with the attention kernel.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from sluice.engine.kv_cache import KVCache
from sluice.engine.models.gpt2 import GPT2LMHeadModel
from sluice.engine.models.native_build import check_status, load_kernel
from sluice.engine.models.step import StepError
from sluice.engine.sampler import draw_uniforms
from sluice.engine.sampling_params import SamplingParams

__all__ = [
    "MAX_NATIVE_CATCH_UP_TOKENS",
    "MAX_NATIVE_DRAFT_SEQUENCES",
    "NativeDraft",
    "NativeDrafts",
]

# A catch-up longer than this (a sequence's first draft, after its prompt) runs as one torch
# forward over the chunk: the C rounds take its tokens one at a time.
MAX_NATIVE_CATCH_UP_TOKENS = 8
# The C rounds run the sequences together (each weight read once a round for up to four),
# and past this many torch's batched rounds cost about as much (bundled draft, one
# thread, 1-3 drafts: C 2.0-2.5x faster at one sequence, 1.2-1.6x at 4-16, even at 32).
MAX_NATIVE_DRAFT_SEQUENCES = 16

_LAYER_FIELDS = (
    "ln_1_weight",
    "ln_1_bias",
    "c_attn_weight",
    "c_attn_bias",
    "attn_proj_weight",
    "attn_proj_bias",
    "ln_2_weight",
    "ln_2_bias",
    "c_fc_weight",
    "c_fc_bias",
    "mlp_proj_weight",
    "mlp_proj_bias",
    "k_cache",
    "v_cache",
)


# The parameters of a block, in _LAYER_FIELDS' order (Hugging Face's names).
_LAYER_PARAMETERS = (
    "ln_1.weight",
    "ln_1.bias",
    "attn.c_attn.weight",
    "attn.c_attn.bias",
    "attn.c_proj.weight",
    "attn.c_proj.bias",
    "ln_2.weight",
    "ln_2.bias",
    "mlp.c_fc.weight",
    "mlp.c_fc.bias",
    "mlp.c_proj.weight",
    "mlp.c_proj.bias",
)


# The block's matrices, which the kernel reads in float16 where the CPU converts it (F16C).
_MATRICES = frozenset(
    ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
)


_int64_p = ctypes.POINTER(ctypes.c_int64)


class _Layer(ctypes.Structure):
    _fields_ = tuple((name, ctypes.c_void_p) for name in _LAYER_FIELDS)


class _Args(ctypes.Structure):
    _fields_ = (
        ("layers", ctypes.POINTER(_Layer)),
        ("wte", ctypes.c_void_p),
        ("head", ctypes.c_void_p),
        ("wpe", ctypes.c_void_p),
        ("ln_f_weight", ctypes.c_void_p),
        ("ln_f_bias", ctypes.c_void_p),
        ("tables", _int64_p),
        ("forced", _int64_p),
        ("forced_start", _int64_p),
        ("first_positions", _int64_p),
        ("num_drafts", _int64_p),
        ("drafts", _int64_p),
        ("num_layers", ctypes.c_int64),
        ("vocab_size", ctypes.c_int64),
        ("hidden", ctypes.c_int64),
        ("inner", ctypes.c_int64),
        ("num_heads", ctypes.c_int64),
        ("max_positions", ctypes.c_int64),
        ("num_seqs", ctypes.c_int64),
        ("table_stride", ctypes.c_int64),
        ("max_drafts", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("num_blocks", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("num_threads", ctypes.c_int32),
        ("temperatures", ctypes.POINTER(ctypes.c_float)),
        ("top_ks", _int64_p),
        ("top_ps", ctypes.POINTER(ctypes.c_double)),
        ("uniforms", ctypes.POINTER(ctypes.c_double)),
        ("probs", ctypes.c_void_p),
    )


class NativeDraft:
    """Drafts of a GPT-2 draft model over its paged cache, by ``gpt2_draft.c``."""

    def __init__(self, library: ctypes.CDLL, model: GPT2LMHeadModel, kv_cache: KVCache) -> None:
        self._function = library.sluice_gpt2_draft_f32
        self._function.argtypes = (ctypes.POINTER(_Args),)
        self._function.restype = ctypes.c_int
        half_weights = library.sluice_gpt2_draft_half_weights
        half_weights.restype = ctypes.c_int
        self._weight_dtype = torch.float16 if half_weights() else torch.float32
        self._model = model
        self._modules = list(model.modules())
        self._kv_cache = kv_cache
        self._layer_key: tuple[tuple[int, int, int], ...] = ()
        self._layer_array: ctypes.Array[_Layer] | None = None
        self._head_source: torch.Tensor | None = None
        self._head_version = 0
        self._head: torch.Tensor | None = None
        self._matrices: list[torch.Tensor] = []  # what _layer_array points into

    @classmethod
    def for_model(cls, model: object, kv_cache: KVCache) -> NativeDraft | None:
        """A drafter for ``model``, or None: not a float32 CPU GPT-2 with a float32 CPU
        cache, kernels turned off, or no compiler."""
        if not isinstance(model, GPT2LMHeadModel):
            return None
        tensors = [*model.parameters(), kv_cache.flat_k[0]]
        if any(t.device.type != "cpu" or t.dtype is not torch.float32 for t in tensors):
            return None
        library = load_kernel("gpt2_draft")
        return None if library is None else cls(library, model, kv_cache)

    def _layers(self) -> ctypes.Array[_Layer]:
        """The blocks' pointers, made again whenever a parameter was replaced or changed."""
        model, cache = self._model, self._kv_cache
        # The modules' own parameter dicts, read directly: model.parameters() walks the
        # module tree with a set of those seen, which cost more than the round it guards.
        key = tuple(
            (id(p), p._version, p.data_ptr())
            for module in self._modules
            for p in module._parameters.values()
            if p is not None
        )
        if self._layer_array is not None and key == self._layer_key:
            return self._layer_array
        layers = (_Layer * model.config.n_layer)()
        matrices: list[torch.Tensor] = []
        for index, block in enumerate(model.transformer.h):
            named = dict(block.named_parameters())
            tensors = []
            for name in _LAYER_PARAMETERS:
                tensor = named[name].detach()
                if name in _MATRICES:  # read in the kernel's weight precision
                    tensor = tensor.to(self._weight_dtype).contiguous()
                    matrices.append(tensor)
                tensors.append(tensor)
            tensors += [cache.flat_k[index], cache.flat_v[index]]
            if not all(t.is_contiguous() for t in tensors):
                raise StepError("the draft's parameters must be contiguous")
            layers[index] = _Layer(*(t.data_ptr() for t in tensors))
        self._matrices = matrices
        self._layer_key, self._layer_array = key, layers
        return layers

    def _kernel_head(self) -> torch.Tensor:
        """The LM head, transposed (``[hidden, vocab]``), in the kernel's weight precision
        (float16 on a CPU with F16C, else float32): made again when the head's weight
        changes."""
        head = self._model.transposed_head()
        if self._head_source is not head or self._head_version != head._version:
            self._head = head.to(self._weight_dtype).contiguous()
            self._head_source, self._head_version = head, head._version
        assert self._head is not None
        return self._head

    def draft(
        self,
        catch_up: Sequence[Sequence[int]],
        first_positions: Sequence[int],
        num_drafts: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        params: Sequence[SamplingParams] | None = None,
        generators: Sequence[torch.Generator | None] | None = None,
    ) -> NativeDrafts:
        """Each sequence's ``num_drafts`` drafts: its ``catch_up`` tokens (at least its last
        token) run from ``first_positions``, then each draft is fed back in. K/V are
        written for every token run: the catch-up and every draft but the last. Without
        ``params`` every sequence drafts greedily; with them, a sampled sequence draws from
        its ``generators`` entry (None: torch's global generator).

        Raises :class:`~sluice.engine.models.step.StepError` for a draft past the model's
        positions or a block table too short, and
        :class:`~sluice.engine.models.native_build.NativeKernelError` for a block
        outside the cache."""
        model, cache = self._model, self._kv_cache
        config = model.config
        num_seqs = len(catch_up)
        if not num_seqs == len(first_positions) == len(num_drafts) == len(block_tables):
            raise StepError("need a position, a draft count and a block table per sequence")
        max_blocks = max(len(table) for table in block_tables)
        # The small per-call arrays as ctypes arrays: a torch tensor each cost several times
        # as much to make, about a fifth of a 4-sequence draft's time in all.
        tables = (ctypes.c_int64 * (num_seqs * max_blocks))()
        for i, table in enumerate(block_tables):
            tables[i * max_blocks : i * max_blocks + len(table)] = list(table)
        starts = [0]
        for tokens in catch_up:
            starts.append(starts[-1] + len(tokens))
        forced = (ctypes.c_int64 * starts[-1])(*(t for tokens in catch_up for t in tokens))
        max_drafts = max(num_drafts)
        drafts = (ctypes.c_int64 * (num_seqs * max_drafts))()
        sampling = _Sampling.of(params, generators, num_drafts, max_drafts, config.vocab_size)
        transformer = model.transformer
        layers = self._layers()
        head_t = self._kernel_head()
        args = _Args(
            layers,
            transformer.wte.weight.data_ptr(),
            head_t.data_ptr(),
            transformer.wpe.weight.data_ptr(),
            transformer.ln_f.weight.data_ptr(),
            transformer.ln_f.bias.data_ptr(),
            tables,
            forced,
            (ctypes.c_int64 * (num_seqs + 1))(*starts),
            (ctypes.c_int64 * num_seqs)(*first_positions),
            (ctypes.c_int64 * num_seqs)(*num_drafts),
            drafts,
            config.n_layer,
            config.vocab_size,
            config.n_embd,
            4 * config.n_embd,
            config.n_head,
            config.n_positions,
            num_seqs,
            max_blocks,
            max_drafts,
            cache.block_size,
            cache.num_blocks,
            config.layer_norm_epsilon,
            torch.get_num_threads(),
            *(
                (None,) * 5
                if sampling is None
                else (
                    sampling.temperatures,
                    sampling.top_ks,
                    sampling.top_ps,
                    sampling.uniforms,
                    sampling.probs.data_ptr(),
                )
            ),
        )
        check_status(
            self._function(ctypes.byref(args)),
            num_blocks=cache.num_blocks,
            what="draft",
            refused=StepError(
                f"draft refused: positions {list(first_positions)}, catch-ups of "
                f"{[len(t) for t in catch_up]}, drafts {list(num_drafts)}, "
                f"{config.n_positions} positions, tables of {max_blocks} blocks"
            ),
        )
        drafted = [
            drafts[i * max_drafts : i * max_drafts + count] for i, count in enumerate(num_drafts)
        ]
        return NativeDrafts(drafted, None if sampling is None else sampling.probs)


class NativeDrafts(NamedTuple):
    """What :meth:`NativeDraft.draft` drafted: each sequence's tokens and, when any sampled,
    every draft's ``q`` (``[num_seqs, max_drafts, vocab]``; a greedy sequence's rows, and
    rows past a sequence's drafts, are zeros)."""

    tokens: list[list[int]]
    probs: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class _Sampling:
    """The kernel's sampling arrays for one call."""

    temperatures: ctypes.Array[ctypes.c_float]
    top_ks: ctypes.Array[ctypes.c_int64]
    top_ps: ctypes.Array[ctypes.c_double]
    uniforms: ctypes.Array[ctypes.c_double]
    probs: torch.Tensor

    @classmethod
    def of(
        cls,
        params: Sequence[SamplingParams] | None,
        generators: Sequence[torch.Generator | None] | None,
        num_drafts: Sequence[int],
        max_drafts: int,
        vocab_size: int,
    ) -> _Sampling | None:
        """The arrays for ``params`` (a greedy sequence gets temperature 0), each sampled
        sequence's uniforms drawn from its generator; None when every sequence is greedy."""
        if params is None or all(p.greedy for p in params):
            return None
        n = len(params)
        if n != len(num_drafts) or (generators is not None and len(generators) != n):
            raise StepError("need sampling params (and a generator) per sequence")
        counts = [0 if p.greedy else count for p, count in zip(params, num_drafts, strict=True)]
        drawn = draw_uniforms([None] * n if generators is None else generators, counts).tolist()
        uniforms = (ctypes.c_double * (n * max_drafts))()
        at = 0
        for i, count in enumerate(counts):
            uniforms[i * max_drafts : i * max_drafts + count] = drawn[at : at + count]
            at += count
        return cls(
            (ctypes.c_float * n)(*(0.0 if p.greedy else p.temperature for p in params)),
            (ctypes.c_int64 * n)(*(p.top_k for p in params)),
            (ctypes.c_double * n)(*(p.top_p for p in params)),
            uniforms,
            torch.zeros((n, max_drafts, vocab_size)),
        )
