"""The paged attention kernel in C (``paged_attention.c``), loaded through ctypes and called
by :func:`~sluice.engine.models.step.paged_attention` for a step's decodes and short
verifies on a float32 CPU cache.

Why C: the torch path copies each sequence's keys and values out of the cache by block
table before it attends; at 64 decoding sequences of ``sluice-tiny`` that copy and the
attention after it were two thirds of the step. The kernel reads K and V in place
(``bench/engine_throughput.py`` has the figures). How it is built, and what happens without
a compiler: :mod:`sluice.engine.models.native_build`. ``SLUICE_NATIVE_KERNELS=0`` turns
it off.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, field

import torch

from sluice.engine.kv_cache import KVCache
from sluice.engine.models.native_build import NativeKernelError, check_status, load_kernel

__all__ = [
    "NativeAttention",
    "NativeGroup",
    "load_native_attention",
]


class _Args(ctypes.Structure):
    _fields_ = (
        ("q", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("rows", ctypes.c_void_p),
        ("row_seqs", ctypes.c_void_p),
        ("row_lens", ctypes.c_void_p),
        ("tables", ctypes.c_void_p),
        ("num_rows", ctypes.c_int64),
        ("q_stride", ctypes.c_int64),
        ("table_stride", ctypes.c_int64),
        ("num_heads", ctypes.c_int64),
        ("num_kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("num_blocks", ctypes.c_int64),
        ("scale", ctypes.c_float),
        ("num_threads", ctypes.c_int32),
        ("k_new", ctypes.c_void_p),
        ("v_new", ctypes.c_void_p),
        ("slots", ctypes.c_void_p),
        ("new_stride", ctypes.c_int64),
    )


class NativeAttention:
    """The loaded kernel (:func:`load_native_attention` makes it)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._function = library.sluice_paged_attention_f32
        self._function.argtypes = (ctypes.POINTER(_Args),)
        self._function.restype = ctypes.c_int

    def call(self, args: _Args) -> None:
        """Run the kernel on ``args``; raise what its status says."""
        check_status(
            self._function(ctypes.byref(args)),
            num_blocks=args.num_blocks,
            what="paged attention",
            refused=NativeKernelError(
                f"paged attention refused {args.num_rows} rows of {args.num_heads} heads "
                f"({args.num_kv_heads} KV heads) of dim {args.head_dim}, block size "
                f"{args.block_size}"
            ),
        )


@dataclass(frozen=True)
class NativeGroup:
    """The query rows of a step that the kernel attends, as contiguous ``int64`` CPU tensors.

    Row ``r`` is the query at packed token ``rows[r]`` of sequence ``row_seqs[r]`` (a row of
    ``tables``, its block table padded), which attends to its first ``row_lens[r]`` keys.
    ``slots``, where given, is the cache slot of each row's own K and V, which
    :meth:`attend` then writes itself when it is given them.
    """

    kernel: NativeAttention
    rows: torch.Tensor
    row_seqs: torch.Tensor
    row_lens: torch.Tensor
    tables: torch.Tensor  # [num_seqs, max_blocks]
    slots: torch.Tensor | None = None
    # The kernel's arguments, the rows' filled in once: each layer sets its tensors'.
    _args: _Args = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        args = _Args()
        args.rows = self.rows.data_ptr()
        args.row_seqs = self.row_seqs.data_ptr()
        args.row_lens = self.row_lens.data_ptr()
        args.tables = self.tables.data_ptr()
        args.num_rows = self.rows.shape[0]
        args.table_stride = self.tables.shape[1]
        if self.slots is not None:
            if self.slots.shape != self.rows.shape or self.slots.dtype != torch.long:
                raise ValueError("need an int64 slot per row")
            args.slots = self.slots.data_ptr()
        object.__setattr__(self, "_args", args)

    def attend(
        self,
        q: torch.Tensor,
        out: torch.Tensor,
        kv_cache: KVCache,
        layer: int,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Write these rows' attention over layer ``layer`` of ``kv_cache`` into ``out``
        (contiguous ``[num_tokens, heads, dim]``), of ``q`` (the same shape, float32, each
        token's heads contiguous). With ``new_kv``, the step's new K and V (``[num_tokens,
        kv_heads, dim]``, float32), each row's are first written to its slot."""
        _, num_heads, head_dim = q.shape
        if q.stride(2) != 1 or q.stride(1) != head_dim:
            q = q.contiguous()
        args = self._args
        args.k_new = args.v_new = None
        if new_kv is not None:
            if self.slots is None:
                raise ValueError("these rows have no slots to write their K and V to")
            k, v = (_heads_contiguous(part) for part in new_kv)
            if k.stride(0) != v.stride(0):
                k, v = k.contiguous(), v.contiguous()
            args.k_new, args.v_new, args.new_stride = k.data_ptr(), v.data_ptr(), k.stride(0)
        args.q = q.data_ptr()
        args.out = out.data_ptr()
        args.k_cache = kv_cache.flat_k[layer].data_ptr()
        args.v_cache = kv_cache.flat_v[layer].data_ptr()
        args.q_stride = q.stride(0)
        args.num_heads = num_heads
        args.num_kv_heads = kv_cache.num_kv_heads
        args.head_dim = head_dim
        args.block_size = kv_cache.block_size
        args.num_blocks = kv_cache.num_blocks
        args.scale = head_dim**-0.5
        args.num_threads = torch.get_num_threads()
        self.kernel.call(args)


def _heads_contiguous(part: torch.Tensor) -> torch.Tensor:
    """``part`` (``[num_tokens, kv_heads, dim]``) as the kernel reads a new K or V row: its
    heads contiguous, float32 on the CPU."""
    if part.dtype is not torch.float32 or part.device.type != "cpu":
        raise ValueError("the kernel writes float32 K and V on the CPU")
    if part.stride(2) == 1 and part.stride(1) == part.shape[2]:
        return part
    return part.contiguous()


def load_native_attention(kv_cache: KVCache | None = None) -> NativeAttention | None:
    """The kernel, built if need be; None when it is turned off, cannot be built, or does
    not fit ``kv_cache`` (which must be float32 on the CPU)."""
    if kv_cache is not None:
        flat_k = kv_cache.flat_k[0]
        if flat_k.device.type != "cpu" or flat_k.dtype is not torch.float32:
            return None
    library = load_kernel("paged_attention")
    return None if library is None else _attention(library)


@functools.cache
def _attention(library: ctypes.CDLL) -> NativeAttention:
    return NativeAttention(library)
