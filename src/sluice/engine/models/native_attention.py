"""The paged attention kernel in C (``paged_attention.c``): built once per machine, loaded
through ctypes, called by :func:`~sluice.engine.models.step.paged_attention` for a step's
decodes and short verifies on a float32 CPU cache.

Why C: the torch path copies each sequence's keys and values out of the cache by block
table before it attends; at 64 decoding sequences of ``sluice-tiny`` that copy and the
attention after it were two thirds of the step. The kernel reads K and V in place
(``bench/engine_throughput.py`` has the figures).

How it is built: the first process that needs it compiles the source with the C compiler
(``$CC``, else ``cc``) for this CPU (``-march=native``) with OpenMP, into
``$SLUICE_KERNEL_CACHE`` (default ``~/.cache/sluice/kernels``), under a name that hashes
the source, the flags, the compiler and the CPU; later processes load that file. The
OpenMP runtime it links is torch's own ``libgomp`` when torch ships one, so both share one
thread pool. When there is no compiler, or the build fails, the engine keeps the torch
path and says so once in the log. ``SLUICE_NATIVE_ATTENTION=0`` turns the kernel off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch

from sluice.engine.kv_cache import KVCache

__all__ = [
    "NativeAttention",
    "NativeAttentionError",
    "NativeGroup",
    "build_kernel",
    "load_native_attention",
]

log = logging.getLogger(__name__)

_SOURCE = "paged_attention.c"
_FLAGS = (
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
    "-fopenmp",
    "-shared",
    "-fPIC",
)
_BUILD_TIMEOUT_S = 120.0
_BAD_BLOCK, _NO_MEMORY = 1, 4  # paged_attention.c: SLUICE_BAD_SHAPE is 2


class NativeAttentionError(ValueError):
    """The kernel refused a call: a block id outside the cache, or sizes that do not fit."""


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
    )


class NativeAttention:
    """The loaded kernel (:func:`load_native_attention` makes it)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._function = library.sluice_paged_attention_f32
        self._function.argtypes = (ctypes.POINTER(_Args),)
        self._function.restype = ctypes.c_int

    def call(self, args: _Args) -> None:
        """Run the kernel on ``args``; raise what its status says."""
        status = self._function(ctypes.byref(args))
        if status == _BAD_BLOCK:
            raise NativeAttentionError(
                f"a block table names a block outside [0, {args.num_blocks})"
            )
        if status == _NO_MEMORY:
            raise MemoryError("paged attention: no memory for the scores")
        if status != 0:
            raise NativeAttentionError(
                f"paged attention refused {args.num_rows} rows of {args.num_heads} heads "
                f"({args.num_kv_heads} KV heads) of dim {args.head_dim}, block size "
                f"{args.block_size}"
            )


@dataclass(frozen=True)
class NativeGroup:
    """The query rows of a step that the kernel attends, as contiguous ``int64`` CPU tensors.

    Row ``r`` is the query at packed token ``rows[r]`` of sequence ``row_seqs[r]`` (a row of
    ``tables``, its block table padded), which attends to its first ``row_lens[r]`` keys.
    """

    kernel: NativeAttention
    rows: torch.Tensor
    row_seqs: torch.Tensor
    row_lens: torch.Tensor
    tables: torch.Tensor  # [num_seqs, max_blocks]
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
        object.__setattr__(self, "_args", args)

    def attend(self, q: torch.Tensor, out: torch.Tensor, kv_cache: KVCache, layer: int) -> None:
        """Write these rows' attention over layer ``layer`` of ``kv_cache`` into ``out``
        (contiguous ``[num_tokens, heads, dim]``), of ``q`` (the same shape, float32, each
        token's heads contiguous)."""
        _, num_heads, head_dim = q.shape
        if q.stride(2) != 1 or q.stride(1) != head_dim:
            q = q.contiguous()
        args = self._args
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


def load_native_attention(kv_cache: KVCache | None = None) -> NativeAttention | None:
    """The kernel, built if need be; None when it is turned off, cannot be built, or does
    not fit ``kv_cache`` (which must be float32 on the CPU)."""
    if os.environ.get("SLUICE_NATIVE_ATTENTION", "1") == "0":
        return None
    if kv_cache is not None:
        flat_k = kv_cache.flat_k[0]
        if flat_k.device.type != "cpu" or flat_k.dtype is not torch.float32:
            return None
    return _load()


@functools.cache
def _load() -> NativeAttention | None:
    cache_dir = Path(
        os.environ.get("SLUICE_KERNEL_CACHE") or Path.home() / ".cache" / "sluice" / "kernels"
    )
    try:
        return NativeAttention(
            ctypes.CDLL(str(build_kernel(cache_dir, os.environ.get("CC") or "cc")))
        )
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        log.warning("paged attention kernel unavailable, using the torch path: %s", exc)
        return None


def _openmp_flags() -> list[str]:
    """Link torch's own libgomp when it ships one: one OpenMP runtime in the process."""
    torch_lib = Path(torch.__file__).parent / "lib"
    if (torch_lib / "libgomp.so.1").exists():
        return [f"-L{torch_lib}", "-l:libgomp.so.1", f"-Wl,-rpath,{torch_lib}"]
    return []


def _cpu_signature() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def build_kernel(cache_dir: Path, compiler: str) -> Path:
    """The kernel's shared library in ``cache_dir``, compiled with ``compiler`` unless a
    build of the same source, flags, compiler and CPU is there already. Raises
    :class:`OSError` when there is no such compiler or it fails."""
    source = resources.files("sluice.engine.models").joinpath(_SOURCE).read_bytes()
    compiler_path = shutil.which(compiler)
    if compiler_path is None:
        raise OSError(f"no C compiler {compiler!r} on PATH")
    version = subprocess.run(
        [compiler_path, "--version"], capture_output=True, check=True, timeout=30
    ).stdout
    flags = [*_FLAGS, *_openmp_flags(), "-lm"]
    digest = hashlib.sha256(
        b"\0".join([source, " ".join(flags).encode(), version, _cpu_signature().encode()])
    ).hexdigest()[:16]
    target = cache_dir / f"paged_attention-{digest}.so"
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as scratch:
        source_path = Path(scratch) / _SOURCE
        source_path.write_bytes(source)
        built = Path(scratch) / target.name
        result = subprocess.run(
            [compiler_path, *_FLAGS, str(source_path), "-o", str(built), *_openmp_flags(), "-lm"],
            capture_output=True,
            timeout=_BUILD_TIMEOUT_S,
        )
        if result.returncode != 0:
            raise OSError(
                f"{compiler} failed ({result.returncode}): "
                f"{result.stderr.decode(errors='replace')[-2000:]}"
            )
        os.replace(built, target)  # atomic: a concurrent build's file is as good
    log.info("built the paged attention kernel: %s", target)
    return target
