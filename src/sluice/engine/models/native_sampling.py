"""Sampling and the sampled speculative verify in C (``sampling.c``), loaded through ctypes:
the fast path of :class:`~sluice.engine.sampler.Sampler` and
:func:`~sluice.engine.acceptance.accept_sampled_many` for float32 logits on the CPU.

Why C: the torch path makes about a dozen whole-batch calls a step (136 µs for 4 rows of
4,096 tokens at T=0.8, 2.5 ms for 64), and a sampled verify of four sequences drafting one
token each about thirty (0.5 ms); the kernel makes a few passes over each row that is
needed. The callers draw the uniforms from each request's generator, in the torch path's
layout, so a seeded request's tokens do not depend on the path but where float rounding
differs. The filters and the one divergence from the torch sampler (top-p's edge by
bisection) are in ``sampling.c``'s header. ``SLUICE_NATIVE_KERNELS=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence

import torch

from sluice.engine.models.native_build import NativeKernelError, check_status, load_kernel
from sluice.engine.sampling_params import SamplingParams

__all__ = ["MAX_VERIFY_DRAFTS", "NativeSampling", "load_native_sampling"]

# The most drafts a sequence's verify takes (the kernel keeps a row maximum per position on
# its stack).
MAX_VERIFY_DRAFTS = 64

_float_p = ctypes.POINTER(ctypes.c_float)
_int64_p = ctypes.POINTER(ctypes.c_int64)
_double_p = ctypes.POINTER(ctypes.c_double)


class _SampleArgs(ctypes.Structure):
    _fields_ = (
        ("logits", ctypes.c_void_p),
        ("temperatures", _float_p),
        ("top_ks", _int64_p),
        ("top_ps", _double_p),
        ("uniforms", ctypes.c_void_p),
        ("tokens", _int64_p),
        ("logprobs", _float_p),
        ("num_rows", ctypes.c_int64),
        ("vocab", ctypes.c_int64),
        ("stride", ctypes.c_int64),
        ("num_threads", ctypes.c_int32),
    )


class _GreedyArgs(ctypes.Structure):
    _fields_ = (
        ("logits", ctypes.c_void_p),
        ("with_logprob", ctypes.POINTER(ctypes.c_uint8)),
        ("tokens", _int64_p),
        ("logprobs", _float_p),
        ("num_rows", ctypes.c_int64),
        ("vocab", ctypes.c_int64),
        ("stride", ctypes.c_int64),
        ("num_threads", ctypes.c_int32),
    )


class _VerifyArgs(ctypes.Structure):
    _fields_ = (
        ("logits", ctypes.c_void_p),
        ("q", ctypes.POINTER(ctypes.c_void_p)),
        ("draft_tokens", _int64_p),
        ("draft_start", _int64_p),
        ("temperatures", _float_p),
        ("top_ks", _int64_p),
        ("top_ps", _double_p),
        ("uniforms", ctypes.c_void_p),
        ("tokens", _int64_p),
        ("logprobs", _float_p),
        ("num_emitted", _int64_p),
        ("num_seqs", ctypes.c_int64),
        ("vocab", ctypes.c_int64),
        ("num_threads", ctypes.c_int32),
    )


def _filters(
    params: Sequence[SamplingParams],
) -> tuple[
    ctypes.Array[ctypes.c_float], ctypes.Array[ctypes.c_int64], ctypes.Array[ctypes.c_double]
]:
    """Each row's temperature, top-k and top-p, as the kernel reads them."""
    n = len(params)
    return (
        (ctypes.c_float * n)(*(p.temperature for p in params)),
        (ctypes.c_int64 * n)(*(p.top_k for p in params)),
        (ctypes.c_double * n)(*(p.top_p for p in params)),
    )


class NativeSampling:
    """The loaded kernel (:func:`load_native_sampling` gives it)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._sample = library.sluice_sample_f32
        self._sample.argtypes = (ctypes.POINTER(_SampleArgs),)
        self._sample.restype = ctypes.c_int
        self._greedy = library.sluice_greedy_f32
        self._greedy.argtypes = (ctypes.POINTER(_GreedyArgs),)
        self._greedy.restype = ctypes.c_int
        self._verify = library.sluice_verify_f32
        self._verify.argtypes = (ctypes.POINTER(_VerifyArgs),)
        self._verify.restype = ctypes.c_int

    def sample(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], uniforms: torch.Tensor
    ) -> tuple[list[int], list[float]]:
        """A token of each row of ``logits`` (``[n, vocab]``, float32 on the CPU) under its
        sampled (not greedy) ``params``, drawn at its uniform (``[n]`` float64), and its
        logprob under the row's unfiltered softmax; -1 (and NaN) for a row that is not
        finite. Raises :class:`NativeKernelError` for params or uniforms out of range."""
        rows = _cpu_float32(logits)
        draws = uniforms.to(torch.float64).contiguous()
        n = rows.shape[0]
        if rows.dim() != 2 or draws.shape != (n,) or len(params) != n:
            raise ValueError("need [n, vocab] logits with one params and one uniform per row")
        tokens = (ctypes.c_int64 * n)()
        logprobs = (ctypes.c_float * n)()
        args = _SampleArgs(
            rows.data_ptr(),
            *_filters(params),
            draws.data_ptr(),
            tokens,
            logprobs,
            n,
            rows.shape[1],
            rows.shape[1],
            torch.get_num_threads(),
        )
        _run(self._sample, args, "sampling", "a temperature, top-k, top-p or uniform")
        return list(tokens), list(logprobs)

    def greedy(
        self, logits: torch.Tensor, with_logprobs: Sequence[bool]
    ) -> tuple[list[int], list[float]]:
        """Each row's first maximum (torch's argmax) of ``logits`` (``[n, vocab]``, float32
        on the CPU) and, where ``with_logprobs`` says so, its logprob under the row's
        softmax (else NaN); -1 (and NaN) for a row that is not finite."""
        if logits.dim() != 2 or logits.device.type != "cpu" or logits.dtype is not torch.float32:
            raise ValueError("the greedy kernel takes [n, vocab] float32 logits on the CPU")
        in_rows = logits.stride(1) == 1 and logits.stride(0) >= logits.shape[1]
        rows = logits if in_rows else logits.contiguous()
        n = rows.shape[0]
        if len(with_logprobs) != n:
            raise ValueError(f"{len(with_logprobs)} logprob flags for {n} rows")
        tokens = (ctypes.c_int64 * n)()
        logprobs = (ctypes.c_float * n)()
        args = _GreedyArgs(
            rows.data_ptr(), (ctypes.c_uint8 * n)(*with_logprobs), tokens, logprobs, n,
            rows.shape[1], rows.stride(0), torch.get_num_threads(),
        )  # fmt: skip
        _run(self._greedy, args, "greedy sampling", "its logits")
        return list(tokens), list(logprobs)

    def verify(
        self,
        logits: torch.Tensor,
        drafts: Sequence[tuple[Sequence[int], torch.Tensor | None]],
        params: Sequence[SamplingParams],
        uniforms: torch.Tensor,
    ) -> list[tuple[list[int], list[float]] | None]:
        """:func:`~sluice.engine.acceptance.accept_sampled_many` with its uniforms given:
        ``logits`` (float32 on the CPU) stacks each sequence's ``k + 1`` rows, ``uniforms``
        each one's ``2 k + 1`` (to accept, for a residual at each position, for the bonus).
        Per sequence the emitted tokens and their logprobs, or None where a row is not
        finite. Raises :class:`NativeKernelError` for arguments out of range."""
        n = len(drafts)
        starts = [0]
        for tokens_, _ in drafts:
            if len(tokens_) > MAX_VERIFY_DRAFTS:
                raise NativeKernelError(f"a verify takes at most {MAX_VERIFY_DRAFTS} drafts")
            starts.append(starts[-1] + len(tokens_))
        rows = _cpu_float32(logits)
        draws = uniforms.to(torch.float64).contiguous()
        vocab = rows.shape[-1]
        if rows.dim() != 2 or rows.shape[0] != starts[-1] + n or len(params) != n:
            raise ValueError("need k + 1 rows of logits and one params per sequence")
        if draws.shape != (2 * starts[-1] + n,):
            raise ValueError("need 2 k + 1 uniforms per sequence")
        # Each q as float32 rows of the vocabulary, kept alive through the call.
        qs = [None if q is None else q.to(torch.float32).contiguous() for _, q in drafts]
        for q, (tokens_, _) in zip(qs, drafts, strict=True):
            if q is not None and tuple(q.shape) != (len(tokens_), vocab):
                raise ValueError("a draft's q must be [k, vocab]")
        total = starts[-1] + n
        tokens = (ctypes.c_int64 * total)()
        logprobs = (ctypes.c_float * total)()
        num_emitted = (ctypes.c_int64 * n)()
        args = _VerifyArgs(
            rows.data_ptr(),
            (ctypes.c_void_p * n)(*(None if q is None else q.data_ptr() for q in qs)),
            (ctypes.c_int64 * starts[-1])(*(t for tokens_, _ in drafts for t in tokens_)),
            (ctypes.c_int64 * (n + 1))(*starts),
            *_filters(params),
            draws.data_ptr(),
            tokens,
            logprobs,
            num_emitted,
            n,
            vocab,
            torch.get_num_threads(),
        )
        _run(self._verify, args, "sampled verify", "a draft token, filter or uniform")
        results: list[tuple[list[int], list[float]] | None] = []
        for s in range(n):
            first, count = starts[s] + s, num_emitted[s]
            if count == 0:
                results.append(None)
            else:
                results.append((tokens[first : first + count], logprobs[first : first + count]))
        return results


def _run(
    function: Callable[[object], int], args: ctypes.Structure, what: str, refusable: str
) -> None:
    """Call the kernel ``function`` on ``args``; raise what its status says."""
    check_status(
        function(ctypes.byref(args)),
        num_blocks=0,
        what=what,
        refused=NativeKernelError(f"{what} refused {refusable}"),
    )


def _cpu_float32(logits: torch.Tensor) -> torch.Tensor:
    if logits.device.type != "cpu" or logits.dtype is not torch.float32:
        raise ValueError("the sampling kernel takes float32 logits on the CPU")
    return logits.contiguous()


def load_native_sampling() -> NativeSampling | None:
    """The kernel, or None: turned off (``SLUICE_NATIVE_KERNELS=0``, read on every call) or
    not built (no compiler)."""
    library = load_kernel("sampling")
    return None if library is None else _wrapped(library)


@functools.cache
def _wrapped(library: ctypes.CDLL) -> NativeSampling:
    return NativeSampling(library)
